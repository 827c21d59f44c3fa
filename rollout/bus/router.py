"""Which engine serves a request: pure bookkeeping, no sockets, so every policy is unit-testable.

Policies (the names in POLICIES, the one list launch config and the rollout manager validate against):
- `round_robin`: baseline only; ignores sessions and load.
- `least_loaded`: the engine with the least work, by the load the servers report (waiting +
  running, refreshed on every reply and heartbeat) and this client's own requests in flight, so
  the signal falls as well as rises.
- `sticky`: a session (one trajectory) stays on the engine its first turn went to, so every
  later turn hits that engine's prefix cache; new sessions go least-loaded.
- `sticky_group`: as sticky, and all sessions of one group (the n GRPO samples of one prompt)
  start on the same engine, so the shared prompt is prefilled once.
A session or group whose engine went down is re-placed on a live one (failover).
"""

from __future__ import annotations

from collections import OrderedDict

POLICIES = ("round_robin", "least_loaded", "sticky", "sticky_group")


class _Lru(OrderedDict):
    """A bounded map: a long run's ended sessions must not grow memory without limit."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: str, value: int) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


class NoEngineAvailable(RuntimeError):
    pass


class Router:
    def __init__(self, num_engines: int, policy: str = "sticky_group", capacity: int = 1_000_000) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {list(POLICIES)}")
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines}: a router needs at least one engine address")
        self.policy = policy
        self.num_engines = num_engines
        self.reported = [0] * num_engines  # load each server last reported
        self.inflight = [0] * num_engines  # this client's requests waiting for a reply
        self.alive = [True] * num_engines
        self.sessions = _Lru(capacity)
        self.groups = _Lru(capacity)
        self._rr = 0

    # ------------------------------------------------------------ signals
    def report_load(self, engine: int, load: int) -> None:
        self.reported[engine] = max(0, int(load))

    def sent(self, engine: int) -> None:
        self.inflight[engine] += 1

    def done(self, engine: int) -> None:
        self.inflight[engine] = max(0, self.inflight[engine] - 1)

    def mark_down(self, engine: int) -> None:
        self.alive[engine] = False

    def mark_up(self, engine: int) -> None:
        self.alive[engine] = True

    def end_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    # ------------------------------------------------------------ decision
    def load(self, engine: int) -> int:
        # The report already counts this client's requests the server had seen; max() avoids
        # double counting while still reacting to requests sent since the last report.
        return max(self.reported[engine], self.inflight[engine])

    def _live(self) -> list[int]:
        live = [i for i in range(self.num_engines) if self.alive[i]]
        if not live:
            raise NoEngineAvailable(f"all {self.num_engines} engines are down; check the server logs")
        return live

    def _least_loaded(self, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        live = [i for i in self._live() if i not in exclude] or self._live()
        self._rr += 1  # rotate the tie-break so equal loads spread instead of piling on engine 0
        return min(live, key=lambda i: (self.load(i), (i - self._rr) % self.num_engines))

    def pick(self, session_id: str | None = None, group_id: str | None = None,
             exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """The engine for the next request; `exclude` holds engines that just failed this request."""
        if self.policy == "round_robin":
            live = [i for i in self._live() if i not in exclude] or self._live()
            self._rr += 1
            return live[self._rr % len(live)]
        if self.policy == "least_loaded" or not session_id:
            return self._least_loaded(exclude)
        engine = self.sessions.get(session_id)
        if engine is None or not self.alive[engine] or engine in exclude:
            engine = None
            if self.policy == "sticky_group" and group_id:
                g = self.groups.get(group_id)
                if g is not None and self.alive[g] and g not in exclude:
                    engine = g
            if engine is None:
                engine = self._least_loaded(exclude)
            if self.policy == "sticky_group" and group_id:
                self.groups.put(group_id, engine)
        self.sessions.put(session_id, engine)
        return engine
