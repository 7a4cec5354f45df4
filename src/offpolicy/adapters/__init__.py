"""Serving adapters: from SGLang / vLLM requests and responses to the sampler record contract.

    from offpolicy.adapters import sglang, Trajectory, collate
    body = sglang.build_request(traj.input_ids, max_new_tokens=256, top_p=0.95, top_k=512, record="support")
    traj.add_turn(sglang.parse_response(response_json, body))
    sequences, batch = collate([traj, ...])        # batch: tokens, sampler_logprobs, candidates, loss_mask [N]

``offpolicy.adapters.sglang`` and ``offpolicy.adapters.vllm`` import neither server package (SGLang's own
``SamplingParams`` is imported only inside ``sglang.validate_request``).
"""

from offpolicy.adapters.common import RecordError, Trajectory, TurnRecord, check_calibration, collate

__all__ = ["RecordError", "Trajectory", "TurnRecord", "check_calibration", "collate"]
