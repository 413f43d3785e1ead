"""The exactness suite every engine adapter passes: served weights equal what was published.

Subclass :class:`EngineExactnessTests` once per engine, model family and swap path (as
zarr-python's backends subclass its ``StoreTests``) and implement the engine hooks; pytest then
runs the checks below against a real server::

    class TestMyEngineQwen3Reload(EngineExactnessTests):
        family = "qwen3"
        swap_path = "reload"

        def make_checkpoint(self, family, out): ...          # a tiny random model, save_pretrained
        def perturb(self, src, out, only, seed): ...         # a copy with the matching tensors moved
        def start_server(self, model, workdir, settings, log_name): ...   # a live server
        def prompt_logprobs(self, url, prompt): ...          # per-token logprobs of a prompt

The family's partial deltas (:data:`PARTIAL_DELTAS`: the updates that break engines, such as one
expert of an MoE layer, a bias alone, the embedding alone of a tied model) move different engine
modules, so the suite publishes them as one step: each module still gets only its partial update,
and the step costs one fresh server. It waits until the server reports the step without error, and
compares the served prompt logprobs with those of a fresh server started on the same checkpoint
with the same settings: exactly, as the engines are deterministic for one request at a time. A
path the engine cannot take is skipped with the engine's reason.

With ``DELTA_SWAP_MATRIX_OUT`` naming a file, each swap (and each skip) is appended to it as a JSON
line: engine, family, path, layout, exact or not, the swap's no-generation window and the test id;
``python -m benchmarks.support_matrix FILE`` prints the README's support matrix from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pytest

#: Per model family, the partial deltas, published together as one step: (what moves, a regular
#: expression over checkpoint names). Each leaves other tensors of the same engine module unchanged,
#: and no two move the same module.
PARTIAL_DELTAS: dict[str, list[tuple[str, str]]] = {
    "llama": [
        (
            "one constituent of each fused module (k_proj; up_proj)",
            r"layers\.0\.self_attn\.k_proj\.|layers\.1\.mlp\.up_proj\.",
        )
    ],
    "qwen2": [
        ("the q/k/v biases alone", r"layers\.0\.self_attn\.[qkv]_proj\.bias"),
        ("one constituent of a fused module (v_proj weight)", r"layers\.1\.self_attn\.v_proj\.weight"),
    ],
    "qwen3": [("the embedding alone of a tied model", r"embed_tokens")],
    "qwen3_moe": [
        ("one expert of one layer", r"layers\.0\.mlp\.experts\.3\."),
        ("the router alone", r"layers\.1\.mlp\.gate\.weight"),
    ],
    "qwen2_moe": [
        (
            "one routed expert and the shared expert's gate",
            r"layers\.1\.mlp\.experts\.5\.|layers\.0\.mlp\.shared_expert_gate\.",
        )
    ],
}

#: The environment variable naming the JSON-lines file each swap's record is appended to.
MATRIX_OUT_ENV = "DELTA_SWAP_MATRIX_OUT"

#: The phases during which the engine generates nothing: a swap's window.
WINDOW_PHASES = ("pause", "swap", "resume")

#: Token-id prompts whose logprobs are compared (short, long, repeated tokens).
PROMPTS: list[list[int]] = [
    [5, 17, 99, 230, 41, 7, 8, 9],
    [300, 301, 302, 7, 8, 9, 10, 11, 12, 400, 401, 402],
    [42, 42, 42, 77, 78, 79, 12, 260, 261, 262, 263],
]


class Server(Protocol):
    """What the suite needs of a running server."""

    url: str

    def stop(self) -> None: ...

    def log_tail(self, lines: int = ...) -> str: ...


@dataclass
class Chain:
    """A plugin server following a store, and the checkpoints published to it so far."""

    server: Server
    store: Path
    workdir: Path
    checkpoints: list[Path] = field(default_factory=list)
    #: Whether the last step moved every layer-0 module (a failure check's step): publishing the
    #: checkpoint before it again moves them all back, and its reference is known already.
    last_moved_layer0: bool = False


#: A server without a store reads ``swap_path`` only to choose how it keeps its weights; arena and
#: in-place swaps both ask for the checkpoint's plain layout, and shadow and reload servers both keep
#: the engine's own (repacked) one, so each pair's references are one server.
REFERENCE_SWAP_PATH = {"inplace": "arena", "shadow": "reload"}


class EngineExactnessTests:
    """Served prompt logprobs after every swap equal a fresh server's on the same checkpoint."""

    #: A key of :data:`PARTIAL_DELTAS`.
    family: ClassVar[str] = "llama"
    #: ``Settings.swap_path`` for the server and the references: auto, arena, inplace, shadow or reload.
    swap_path: ClassVar[str] = "auto"
    #: Other ``Settings`` fields for the plugin server.
    settings: ClassVar[Mapping[str, object]] = {}
    #: Whether a read-back may report some worker skipped (none may, tensor-parallel ranks included).
    read_back_may_skip: ClassVar[bool] = False
    #: Extra engine arguments, the same for the plugin server and the references (the layout: TP, DP...).
    extra: tuple[str, ...] = ()
    #: The adapter's name as its status gives it, for a record made when the server did not start.
    engine: ClassVar[str] = ""
    #: On the shadow path, the partial deltas (by what moves) that load into a module the engine
    #: cannot build as a shadow, so that the step is reloaded instead (the status says why).
    reloaded: ClassVar[frozenset[str]] = frozenset()
    #: The swap path a reference server (no store) is started with, by the path under test: paths
    #: that hold the weights the same way share their references.
    reference_swap_path: ClassVar[Mapping[str, str]] = REFERENCE_SWAP_PATH
    #: With ``swap_path = "auto"``: the path auto must take here unless the engine holds its weights
    #: in another form than the checkpoint (then the status says so, and the check is skipped).
    auto_takes: ClassVar[str | None] = None

    # ------------------------------------------------------------------ engine hooks

    def make_checkpoint(self, family: str, out: Path) -> Path:
        """Write a tiny random checkpoint of ``family`` (with its config and tokenizer) to ``out``."""
        raise NotImplementedError

    def perturb(self, src: Path, out: Path, only: str, seed: int) -> Path:
        """Copy ``src`` to ``out`` with the tensors whose names match ``only`` moved by a few ULPs."""
        raise NotImplementedError

    def start_server(self, model: Path, workdir: Path, settings: Mapping[str, object], log_name: str) -> Server:
        """Start the engine with the plugin on ``model`` and wait until it is healthy; without a
        ``store`` in ``settings`` it is a plain server with the same flags (the reference)."""
        raise NotImplementedError

    def prompt_logprobs(self, url: str, prompt: list[int]) -> list[Any]:
        """The engine's logprobs of every token of ``prompt`` (one request, nothing else running)."""
        raise NotImplementedError

    def cannot_run(self, error: str) -> str | None:
        """Why the engine cannot run this family on this machine, read from the ``error`` of a server
        that did not start (with its log's tail); None (the default) when it is a failure."""
        return None

    def publish(self, store: Path, step: int, checkpoint: Path) -> None:
        """Publish ``checkpoint`` as ``step`` (a base at step 0), as a trainer would."""
        from safetensors.torch import load_file  # numpy has no bfloat16

        from ..publisher import Publisher, PublisherConfig

        with Publisher(str(store), PublisherConfig(base_every=1000)) as pub:
            tensors: dict[str, Any] = {}
            for file in sorted(checkpoint.glob("*.safetensors")):
                tensors.update(load_file(str(file)))
            pub.publish(step, tensors)

    # ------------------------------------------------------------------ the checks

    @pytest.fixture(scope="class")
    @classmethod
    def chain(cls, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Chain]:
        self = cls()
        workdir = tmp_path_factory.mktemp(f"{self.family}-{self.swap_path}")
        base = self.make_checkpoint(self.family, workdir / "step-0")
        store = workdir / "store"
        self.publish(store, 0, base)
        settings = {
            "store": store.as_uri(),
            "poll_interval": 0.2,
            "drain": "wait",
            "swap_path": self.swap_path,
            "verify_swaps": "always",
            **self.settings,
        }
        try:
            server = self.start_server(base, workdir, settings, "plugin.log")
        except Exception as exc:  # a server that did not start: skip only what the engine cannot run
            reason = self.cannot_run(str(exc))
            if reason is None:
                raise
            self._record(request, {"engine": self.engine, "swap_path": None}, skipped=reason)
            pytest.skip(reason)  # once for the class: pytest keeps a class fixture's outcome
        try:
            wait_for(server.url, lambda s: s["current_step"] == 0 and s.get("swap_path") is not None, 300)
            yield Chain(server, store, workdir, [base])
        finally:
            server.stop()

    def test_the_server_takes_the_path_it_was_asked_for(self, chain: Chain) -> None:
        st = status(chain.server.url)
        assert st["swap_path_reason"], st
        if self.swap_path == "reload":
            assert st["swap_path"] in ("reload", "tensor"), st
        elif self.swap_path in ("arena", "inplace", "shadow") and st["swap_path"] != self.swap_path:
            pytest.skip(_cannot_take(st, self.family, self.swap_path))
        elif self.swap_path == "auto" and self.auto_takes and st["swap_path"] != self.auto_takes:
            # only an engine that holds its weights in another form here may take another path
            assert "another form" in st["swap_path_reason"], st
            pytest.skip(_cannot_take(st, self.family, self.auto_takes))

    def test_every_partial_delta_serves_what_a_fresh_server_serves(
        self, chain: Chain, request: pytest.FixtureRequest
    ) -> None:
        st = status(chain.server.url)
        if self.swap_path in ("arena", "inplace", "shadow") and st["swap_path"] != self.swap_path:
            reason = _cannot_take(st, self.family, self.swap_path)
            self._record(request, st, skipped=reason)
            pytest.skip(reason)
        deltas = PARTIAL_DELTAS[self.family]
        what, only = "; ".join(w for w, _ in deltas), "|".join(f"(?:{o})" for _, o in deltas)
        step = len(chain.checkpoints)
        before = self._served(chain.server.url)
        checkpoint = self.perturb(chain.checkpoints[-1], chain.workdir / f"step-{step}", only, seed=step)
        chain.checkpoints.append(checkpoint)
        chain.last_moved_layer0 = False
        self.publish(chain.store, step, checkpoint)

        st = wait_for(chain.server.url, lambda s: s["current_step"] == step or s["failures"] > 0, 300)
        assert st["current_step"] == step and st["last_error"] is None, (what, st)
        if st["swap_path"] == "shadow":  # built as shadows, or reloaded where the engine said so
            fallback = (st.get("last_staged") or {}).get("fallback")
            assert bool(fallback) == any(w in self.reloaded for w, _ in deltas), (what, st)
        verification = st.get("last_verification")
        if st["swap_path"] in ("reload", "tensor", "inplace", "shadow"):  # read back with verify_swaps=always
            assert verification is not None, st
            assert verification["checks"] > 0, st  # the read-back ran (every tensor-parallel rank too)
            assert self.read_back_may_skip or not verification.get("skipped"), st
        served = self._served(chain.server.url)
        reference = self._reference(checkpoint, chain.workdir, f"ref-{step}.log")
        difference = _max_difference(served, reference)
        self._record(request, st, step=step, what=what, exact=served == reference, max_difference=difference)
        assert reference != before, f"step {step} ({what}) changes no logprob: the check could not fail"
        if served != reference:
            previous = self._reference(chain.checkpoints[-2], chain.workdir, f"ref-{step - 1}.log")
            pytest.fail(
                f"{self.family}, step {step} ({what}), {st['swap_path']} path: served logprobs differ from a fresh "
                f"server's on the same checkpoint, max |difference| {difference:.3g}; "
                + _diagnosis(served, reference, before, previous)
                + f"; status: {json.dumps(st, default=str)}"
            )

    # ------------------------------------------------------------------ helpers

    def _record(self, request: pytest.FixtureRequest, st: Mapping[str, Any], **fields: object) -> None:
        """Append one swap's (or a skip's) matrix record to ``$DELTA_SWAP_MATRIX_OUT``, if set."""
        out = os.environ.get(MATRIX_OUT_ENV)
        if not out:
            return
        timings = st.get("last_update_timings_s") or {}
        record = {
            "engine": st["engine"],
            "family": self.family,
            "path": self.swap_path,
            "taken": st["swap_path"],
            "layout": " ".join(self.extra),
            **fields,
            "window_s": None if "skipped" in fields else round(sum(timings.get(p, 0.0) for p in WINDOW_PHASES), 6),
            "timings_s": None if "skipped" in fields else timings,
            "test": request.node.nodeid,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _served(self, url: str) -> list[list[Any]]:
        return [self.prompt_logprobs(url, prompt) for prompt in PROMPTS]

    def _reference(self, checkpoint: Path, workdir: Path, log_name: str) -> list[list[Any]]:
        """A fresh server's logprobs on ``checkpoint``: started once per checkpoint content, engine
        and flags in a test session (classes of one family share their references)."""
        swap_path = self.reference_swap_path.get(self.swap_path, self.swap_path)
        settings = {"swap_path": swap_path, **{k: v for k, v in self.settings.items() if k != "store"}}
        engine, flags = type(self).engine or type(self).__module__, json.dumps(settings, sort_keys=True, default=str)
        key = (engine, flags, self.extra, _digest(checkpoint))
        if key not in _REFERENCES:
            server = self.start_server(checkpoint, workdir, settings, log_name)
            try:
                _REFERENCES[key] = self._served(server.url)
            finally:
                server.stop()
        return _REFERENCES[key]


class InjectedFailureTests(EngineExactnessTests):
    """A failure injected into a swap (a marker file the test makes, read by the server: see
    :data:`delta_swap.staged_swap.FAIL_SCATTER_ENV`) leaves the previous weights served exactly; the
    retry then swaps the step in. An engine's :meth:`start_server` passes :meth:`failure_env` on."""

    @staticmethod
    def failure_marker(workdir: Path, env: str, log_name: str) -> Path:
        """The marker file that injects ``env``'s failure into the server logging to ``log_name``."""
        return workdir / f"{env.lower()}-{log_name}"

    def failure_env(self, workdir: Path, log_name: str) -> dict[str, str]:
        """The environment that points the server at its marker files."""
        from ..staged_swap import FAIL_BUILD_ENV, FAIL_SCATTER_ENV

        return {env: str(self.failure_marker(workdir, env, log_name)) for env in (FAIL_SCATTER_ENV, FAIL_BUILD_ENV)}

    def check_a_failed_swap(self, chain: Chain, env: str, message: str, marker_text: str = "1") -> None:
        """Make ``env``'s marker (by default: fail after the first parameter or module, on every
        rank), publish a step that changes every layer-0 module, and check the failure, the served
        weights and the retry."""
        st = status(chain.server.url)
        expected = self.auto_takes if self.swap_path == "auto" else self.swap_path
        if st["swap_path"] != expected:
            pytest.skip(_cannot_take(st, self.family, expected or self.swap_path))
        marker = self.failure_marker(chain.workdir, env, "plugin.log")
        step, failures = len(chain.checkpoints), st["failures"]
        before = self._served(chain.server.url)
        marker.write_text(marker_text)
        try:
            if chain.last_moved_layer0:  # back to the checkpoint before: one fresh server fewer
                checkpoint = chain.checkpoints[-2]
            else:
                checkpoint = self.perturb(chain.checkpoints[-1], chain.workdir / f"step-{step}", r"layers\.0\.", step)
            self.publish(chain.store, step, checkpoint)
            st = wait_for(chain.server.url, lambda s: s["failures"] > failures or s["current_step"] == step, 300)
            assert st["current_step"] == step - 1 and message in (st["last_error"] or ""), st
            assert self._served(chain.server.url) == before, "the undone swap left other weights served"
        finally:
            marker.unlink(missing_ok=True)
        chain.checkpoints.append(checkpoint)
        chain.last_moved_layer0 = True
        wait_for(chain.server.url, lambda s: s["current_step"] == step, 300)  # the retry swaps it in
        reference = self._reference(checkpoint, chain.workdir, f"ref-{step}.log")
        assert self._served(chain.server.url) == reference
        assert reference != before


def status(url: str) -> dict[str, Any]:
    """A delta-swap server's ``/delta_swap/status``."""
    import httpx

    return httpx.get(f"{url}/delta_swap/status", timeout=30).json()


def wait_for(url: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 120) -> dict[str, Any]:
    """Poll the status route until ``pred`` holds; fail with the last status otherwise."""
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = status(url)
        if pred(st):
            return st
        time.sleep(0.2)
    raise AssertionError(f"timed out; status: {json.dumps(st, indent=1)}")


#: Reference logprobs of this test session, by (engine, settings, extra arguments, checkpoint digest).
_REFERENCES: dict[tuple[Any, ...], list[list[Any]]] = {}


def _digest(folder: Path) -> str:
    """SHA-256 over the names and bytes of a checkpoint folder's files."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _diagnosis(served: list[Any], reference: list[Any], before: list[Any], previous: list[Any]) -> str:
    """What a failed comparison says about the cause: whether the server still served the last
    step's values (a swap that did not reach the computation), whether it served the previous
    checkpoint exactly before the swap (a server that was off from the start), and where the
    logprobs differ (prompt, part, position)."""
    where = []
    for i, (got, want) in enumerate(zip(served, reference, strict=True)):
        for part, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                positions = [k for k, (x, y) in enumerate(zip(g, w)) if x != y] if len(g) == len(w) else ["length"]
                where.append(f"prompt {i} part {part} positions {positions[:8]}")
    return (
        f"served == the last step's values: {served == before}; "
        f"before the swap the server served the previous checkpoint exactly: {before == previous} "
        f"(max |difference| {_max_difference(before, previous):.3g}); differences at: {'; '.join(where)}"
    )


def _max_difference(a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]]) -> float:
    """Largest |difference| between two nested lists of numbers (inf where their shapes differ)."""
    flat_a, flat_b = _numbers(a), _numbers(b)
    if len(flat_a) != len(flat_b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(flat_a, flat_b)), default=0.0)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _numbers(v)]
    return []


def _cannot_take(st: Mapping[str, Any], family: str, path: str) -> str:
    """Why the engine took another path than the one asked for (its status says why)."""
    how = {"arena": "by reference", "inplace": "in place", "shadow": "by shadow modules"}.get(
        path, f"on the {path} path"
    )
    return f"{st['engine']} cannot swap {family} {how} here: {st['swap_path_reason']}"
