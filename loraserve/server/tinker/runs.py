"""Training runs as the Tinker routes know them: who owns each, its adapter id, its checkpoints.

A run belongs to the tenant of the key that created it (`tenant_of`): its adapter id is
`<tenant>/<run id>` in that tenant's namespace, so its sampler revisions are served, listed and
hidden exactly as that tenant's other adapters are.
A key that may not see that tenant gets the 404 of a run that does not exist (`RunRegistry.get`).

Operations of one run execute in the order they arrived (`RunRecord.chain`): the SDK sends
forward_backward and optim_step back to back without waiting, and expects them applied in order.
Names: `tinker://<run>/sampler_weights/<name>` is an alias of `<tenant>/<run>@<name>` in the
catalog; `tinker://<run>/weights/<name>` a training-state file under the state directory.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loraserve.catalog.ids import DEFAULT_TENANT
from loraserve.keys import ALL_TENANTS, Principal
from loraserve.server.errors import APIError, clip

log = logging.getLogger(__name__)
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_RUNS_PER_TENANT = 8  # runs held at once by one tenant (each holds factors + Adam state)


def tenant_of(principal: Principal) -> str:
    """The tenant a key's runs live in: its first tenant; the default one for a key of all
    tenants (an admin, or a server without keys)."""
    named = [t for t in principal.tenants if t != ALL_TENANTS]
    return named[0] if named and not principal.admin else DEFAULT_TENANT


def checkpoint_name(name: str, param: str = "path") -> str:
    if not CHECKPOINT_NAME.fullmatch(name):
        raise APIError(400, f"checkpoint name {clip(name)!r} must be 1-64 of A-Z a-z 0-9 . _ -",
                       param=param)
    return name


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


@dataclass(slots=True)
class RunRecord:
    """One training run (API side; its factors live in the engine core)."""

    model_id: str
    owner: str | None
    tenant: str
    base_model: str
    config: dict[str, Any]
    user_metadata: dict[str, str] | None
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    sampler_saves: int = 0
    tail: asyncio.Future | None = None
    writing: asyncio.Future | None = None  # the catalog write of its last unnamed save
    steps: int = 0  # optim_steps answered (or the step count of the state last loaded)
    grads_pending: int = 0  # forward_backward calls since its last optim_step
    lost_grads: bool = False  # the engine core restarted and lost gradients of this step
    lost_steps: tuple[int, int] | None = None  # (put back at, had answered): its resume state was behind

    @property
    def adapter_id(self) -> str:
        return f"{self.tenant}/{self.model_id}"

    def chain(self, op: Callable[[], Awaitable[Any]]) -> asyncio.Task:
        """Run `op` after every operation of this run submitted before it (whatever became of them)."""
        prev = self.tail

        async def ordered() -> Any:
            if prev is not None:
                await asyncio.wait({prev})
            self.last_request = time.time()
            return await op()

        task = asyncio.ensure_future(ordered())
        self.tail = task
        return task

    def write_behind(self, write: Callable[[], Awaitable[Any]]) -> None:
        """Start `write` (a revision's catalog write) without waiting for it; `written` waits."""
        self.writing = asyncio.ensure_future(write())
        self.writing.add_done_callback(self._log_failure)

    def _log_failure(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("training run %s: a sampler save's catalog write failed: %s", self.model_id,
                      task.exception())

    async def written(self) -> None:
        """Wait for the last write-behind: the next save's revision is promoted after it, and a
        run unloaded leaves its revisions in the catalog. Its failure is raised here, once."""
        writing, self.writing = self.writing, None
        if writing is not None:
            try:
                await writing
            except Exception as exc:
                raise RuntimeError(f"the catalog write of {self.model_id}'s last sampler save failed "
                                   f"(its sampler served it from memory): {exc}") from exc

    def add_checkpoint(self, kind: str, name: str, size: int) -> dict[str, Any]:
        """Record a checkpoint ("training" or "sampler"), replacing one of the same path."""
        segment = "weights" if kind == "training" else "sampler_weights"
        path = f"tinker://{self.model_id}/{segment}/{name}"
        entry = {"checkpoint_id": f"{segment}/{name}", "checkpoint_type": kind, "time": iso(time.time()),
                 "tinker_path": path, "size_bytes": size, "public": False, "expires_at": None}
        self.checkpoints = [c for c in self.checkpoints if c["tinker_path"] != path] + [entry]
        return entry

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in reversed(self.checkpoints) if c["checkpoint_type"] == kind), None)

    def describe(self, owner_name: str) -> dict[str, Any]:
        """The SDK's TrainingRun."""
        return {"training_run_id": self.model_id, "base_model": self.base_model, "model_owner": owner_name,
                "is_lora": True, "corrupted": False, "lora_rank": self.config["rank"],
                "last_request_time": iso(self.last_request), "last_checkpoint": self.last("training"),
                "last_sampler_checkpoint": self.last("sampler"), "user_metadata": self.user_metadata}


class RunRegistry:
    """The server's runs by model id, and where training-state checkpoints are written."""

    def __init__(self, state_dir: Path, max_per_tenant: int = MAX_RUNS_PER_TENANT):
        self.state_dir = state_dir
        self.max_per_tenant = max_per_tenant
        self.runs: dict[str, RunRecord] = {}

    def add(self, record: RunRecord) -> None:
        held = sum(1 for r in self.runs.values() if r.tenant == record.tenant)
        if held >= self.max_per_tenant:
            raise APIError(429, f"tenant {record.tenant!r} holds {held} training runs, the most it may; "
                           "unload one (TrainingClient... unload_model) first", code="too_many_runs")
        self.runs[record.model_id] = record

    def get(self, model_id: str, principal: Principal) -> RunRecord:
        """The run, if this key's tenant owns it; else the 404 of a run that does not exist."""
        run = self.runs.get(model_id)
        if run is None or not principal.sees(run.tenant):
            raise APIError(404, f"training run {clip(model_id)!r} does not exist (unloaded, or the "
                           "server restarted)", code="model_not_found", param="model_id")
        return run

    async def written(self, name: str) -> None:
        """Wait while the catalog write of a run's last unnamed save is in flight, if `name`
        (`tinker://<tenant>/<run>@s<n>`, or any model name) is that run's: a lookup by the name
        then finds the revision. Its failure is left for the run's next save to raise."""
        run = self.runs.get(name.removeprefix("tinker://").split("@")[0].split("/")[-1])
        if run is not None and run.writing is not None:
            await asyncio.wait({run.writing})

    def visible(self, principal: Principal) -> list[RunRecord]:
        return [r for r in self.runs.values() if principal.sees(r.tenant)]

    def resume_file(self, run: RunRecord) -> Path:
        """The run's state after its last optim_step, to put it back in an engine core that
        restarted (not a checkpoint: no tinker:// name reaches it). The engine writes it
        (engine/core/training.py), behind each step's answer."""
        return self.state_dir / run.tenant / run.model_id / "resume.state"

    def state_file(self, tenant: str, model_id: str, name: str) -> Path:
        """Where a training-state checkpoint lives: under its tenant, so only that tenant finds it."""
        return self.state_dir / tenant / model_id / f"{checkpoint_name(name)}.safetensors"

    def checkpoint_file(self, path: str, principal: Principal) -> Path:
        """The file of `tinker://<run>/weights/<name>` in a tenant this key sees; 404 otherwise
        (also after its run was unloaded: checkpoints outlive runs)."""
        model_id, name = parse_weights_path(path, "training")
        tenants = ([d.name for d in self.state_dir.iterdir() if d.is_dir()] if self.state_dir.is_dir() else []) \
            if principal.sees(ALL_TENANTS) else [t for t in principal.tenants if t != ALL_TENANTS]
        for tenant in tenants:
            f = self.state_file(tenant, model_id, name)
            if f.is_file():
                return f
        raise APIError(404, f"checkpoint {clip(path)!r} does not exist", code="checkpoint_not_found",
                       param="path")

    def checkpoint_meta(self, path: str, principal: Principal) -> dict[str, str]:
        """The run config a training-state checkpoint was saved with (its safetensors metadata)."""
        with self.checkpoint_file(path, principal).open("rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return json.loads(f.read(n)).get("__metadata__") or {}


def parse_weights_path(path: str, kind: str) -> tuple[str, str]:
    """`tinker://<run>/<weights|sampler_weights>/<name>` -> (run, name); 400 otherwise."""
    segment = "weights" if kind == "training" else "sampler_weights"
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != segment:
        raise APIError(400, f"{clip(path)!r} is not a tinker://<run>/{segment}/<name> path", param="path")
    return parts[0], checkpoint_name(parts[2])
