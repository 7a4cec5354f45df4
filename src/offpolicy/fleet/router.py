"""A capacity-proportional, sticky session router with balanced shares over time.

Each agent session is pinned to one sampler group for its life (its KV cache and prefix cache live there).
New sessions are placed so that every group's cumulative load follows its capacity share as closely as an
integer assignment can: the Balinski-Young *quota method* of apportionment.

With ``n`` units routed so far and shares ``w_g`` (capacity over total capacity), each group has a cumulative
target ``T_g = sum over units of w_g`` (``= n w_g`` while capacities are fixed) and a load ``L_g``. The next
unit goes to the group maximising ``T'_g / (L_g + 1)`` (``T'`` the targets after this unit; Jefferson's
priority) among the groups with ``L_g < T'_g`` (those that stay within their upper quota). Balinski and Young
(1975) proved that this keeps every group within one unit of its exact quota at every ``n``:

    floor(n w_g) <= L_g <= ceil(n w_g),   so   |L_g - n w_g| < 1.

When capacities change (autoscaling), the targets accumulate the shares in force at each unit and the upper
bound ``L_g - T_g < 1`` still holds (some group is always eligible because the loads sum to less than the new
targets); a group that was starved while another scaled can lag its target by up to ``m - 1`` units (``m``
groups), and catches up as new sessions arrive.

``balance="sessions"`` counts one unit per new session. ``balance="requests"`` counts every request (each
:meth:`Router.assign` call, sticky ones included, weighted by ``weight``, e.g. the request's tokens): the
router then steers *new* sessions towards the groups whose served load lags, which is how shares of requests
stay balanced although long sessions cannot be moved.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence

from offpolicy.fleet.groups import SamplerGroup

BALANCE_MODES = ("sessions", "requests")


class Router:
    """Route sessions to sampler groups in proportion to capacity, sticky per session.

    Args:
        groups: the fleet; names must be unique and at least one capacity positive.
        balance: ``"sessions"`` or ``"requests"`` (see the module docstring).
        seed: if given, ties between equally entitled groups are broken in a seeded random order instead of
            the order of ``groups``.

    Example::

        router = Router(seed_fleet())
        group = router.assign("episode-17")        # a SamplerGroup; the same one for every later call
        url = group.endpoint
    """

    def __init__(self, groups: Sequence[SamplerGroup], balance: str = "sessions", seed: int | None = None):
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {balance!r}")
        groups = list(groups)
        if not groups or not all(isinstance(g, SamplerGroup) for g in groups):
            raise ValueError("groups must be a non-empty sequence of SamplerGroup")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        if not any(g.capacity > 0 for g in groups):
            raise ValueError("at least one group must have capacity > 0")
        self.balance = balance
        self._groups: dict[str, SamplerGroup] = {g.name: g for g in groups}
        self._order = list(names)
        if seed is not None:
            random.Random(seed).shuffle(self._order)
        self._target = dict.fromkeys(names, 0.0)
        self._load = dict.fromkeys(names, 0.0)
        self._sessions: dict[Hashable, str] = {}

    # ------------------------------------------------------------------ routing
    def assign(self, session_id: Hashable, weight: float = 1.0) -> SamplerGroup:
        """The group serving ``session_id``: its pinned group, or a newly chosen one for a new session.

        A session pinned to a group whose capacity has since dropped to 0 is re-routed as a new session.
        ``weight`` (``> 0``) is the size of this request for ``balance="requests"`` (ignored for sessions).
        """
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
        pinned = self._sessions.get(session_id)
        if pinned is not None and self._groups[pinned].capacity > 0:
            if self.balance == "requests":
                self._advance(weight)
                self._load[pinned] += weight
            return self._groups[pinned]
        unit = weight if self.balance == "requests" else 1.0
        new_target = self._advanced_targets(unit)
        positive = [n for n in self._order if self._groups[n].capacity > 0]
        scale = max(1.0, max(new_target.values()))
        eligible = [n for n in positive if self._load[n] < new_target[n] - 1e-9 * scale] or positive
        name = max(eligible, key=lambda n: new_target[n] / (self._load[n] + unit))
        self._target = new_target
        self._load[name] += unit
        self._sessions[session_id] = name
        return self._groups[name]

    def route(self, session_id: Hashable, weight: float = 1.0) -> str:
        """The name of :meth:`assign`'s group."""
        return self.assign(session_id, weight).name

    def release(self, session_id: Hashable) -> None:
        """The session ended: forget its pin (the load it generated stays in the totals)."""
        self._sessions.pop(session_id, None)

    def group_of(self, session_id: Hashable) -> SamplerGroup | None:
        """The group a session is pinned to, or ``None``."""
        name = self._sessions.get(session_id)
        return self._groups[name] if name is not None else None

    # ------------------------------------------------------------------ fleet changes
    def set_capacity(self, name: str, capacity: float) -> None:
        """Change a group's capacity (autoscaling); 0 drains it (its sessions move at their next request)."""
        if name not in self._groups:
            raise KeyError(f"no group named {name!r}; groups: {list(self._groups)}")
        g = self._groups[name]
        new = SamplerGroup(g.name, g.accelerator, g.weight_format, g.kv_format, capacity, g.endpoint)
        if new.capacity == 0 and not any(o.capacity > 0 for n, o in self._groups.items() if n != name):
            raise ValueError("cannot drain the last group with capacity > 0")
        self._groups[name] = new

    def add_group(self, group: SamplerGroup) -> None:
        """Add a group (it starts with zero load and zero target, so it fills from its share on)."""
        if group.name in self._groups:
            raise ValueError(f"a group named {group.name!r} exists already")
        self._groups[group.name] = group
        self._order.append(group.name)
        self._target[group.name] = 0.0
        self._load[group.name] = 0.0

    # ------------------------------------------------------------------ state
    @property
    def groups(self) -> list[SamplerGroup]:
        return [self._groups[n] for n in self._groups]

    def shares(self) -> dict[str, float]:
        """Current capacity shares ``w_g``."""
        total = sum(g.capacity for g in self._groups.values())
        return {n: g.capacity / total for n, g in self._groups.items()}

    def load(self) -> dict[str, float]:
        """Units routed to each group so far (sessions, or request weight)."""
        return dict(self._load)

    def targets(self) -> dict[str, float]:
        """Each group's cumulative target ``T_g``."""
        return dict(self._target)

    def realised_shares(self) -> dict[str, float]:
        """Each group's share of all units routed so far."""
        total = sum(self._load.values())
        return {n: (v / total if total > 0 else 0.0) for n, v in self._load.items()}

    def active_sessions(self) -> dict[str, int]:
        """Pinned (not released) sessions per group."""
        out = dict.fromkeys(self._groups, 0)
        for name in self._sessions.values():
            out[name] += 1
        return out

    def _advanced_targets(self, unit: float) -> dict[str, float]:
        shares = self.shares()
        return {n: self._target[n] + shares[n] * unit for n in self._target}

    def _advance(self, unit: float) -> None:
        self._target = self._advanced_targets(unit)
