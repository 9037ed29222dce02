"""EdgeSession: the app-facing API. Drafts trees locally and has them verified.

The decode loop is deliberately small: sync -> grow a tree -> verify -> commit. The verifier is
anything with `sync(committed)`, `verify(tree, sampling, step)` and `close()`: the in-process
llama.cpp target (local mode) or the gRPC link to a verifier service.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from edgespec.common import modelstore
from edgespec.common.constraints import Grammar, TokenConstraint
from edgespec.common.errors import (
    ContextOverflowError,
    InvalidRequestError,
    SessionBusyError,
    SessionClosedError,
    TokenizerMismatchError,
)
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.edge.decoder import Decoder, SessionStats, Verifier
from edgespec.edge.drafting import Drafter, TreeShape
from edgespec.edge.planner import LADDER, Planner
from edgespec.edge.privacy import Masker, PrivacyError, make_masker
from edgespec.runtime.llama import ALL_LAYERS, ContextConfig, LlamaModel, TextStream, gpu_offload_supported
from edgespec.runtime.tree_verifier import LocalVerifier

if TYPE_CHECKING:
    from edgespec.edge.embedded import EmbeddedVerifier
    from edgespec.edge.failover import FailoverVerifier, SwitchEvent
    from edgespec.edge.pool import DraftPool, Expert
    from edgespec.edge.router import RoutedPlanner, Router

Messages = str | Sequence[dict[str, str]]
RECENT_TURNS = 2       # earlier user turns in the router's context (embedded once each, cached)
SKIP_MODELS_AT = 2.0   # router pools: skip the draft model on steps where the lookup promises 2 tokens


def tree_nodes_needed(shapes: Sequence[TreeShape]) -> int:
    """KV rows one step may need: the root plus the larger of the frontier decodes and the budget."""
    return max(max(s.width * s.max_depth, s.budget) for s in shapes) + 1


def context_reserve(shapes: Sequence[TreeShape]) -> int:
    """KV cells a step may use beyond the committed context: the tree's nodes, plus (when drafting
    ahead) the guessed accepted path and the guessed next token the next tree grows from."""
    return tree_nodes_needed(shapes) + max(s.max_depth for s in shapes) + 2


def available_cpus() -> int:
    """CPUs this process may run on (affinity and cpusets count, not just the machine's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads(remote: bool, cpus: int | None = None) -> tuple[int, int]:
    """(draft, target) llama.cpp threads when the caller sets none.

    llama.cpp's workers spin while they wait for each other, so threads that outnumber the free
    cores stall: one core always stays free for the decode loop, gRPC, the app, and whatever else
    shares the machine. Remote mode: the target runs elsewhere and the edge only drafts, so the
    drafter takes every core but that one, up to 8 (a draft model gains little beyond); the free
    core matters here too, since the drafter's spinning workers would otherwise stall a fallback
    target or a verifier sharing the cores. Local and bundled modes: both models run at once (the
    target verifies while the drafter drafts ahead): the drafter gets a quarter of the cores (1 to
    4) and the target the rest. The local target of remote mode (the fallback) gets the target's
    local share. Never less than 1.
    """
    cpus = cpus or available_cpus()
    local_draft = max(1, min(4, cpus // 4))
    target = max(1, cpus - 1 - local_draft)
    return (max(1, min(8, cpus - 1)) if remote else local_draft), target


def default_gpu_layers() -> int:
    """Every layer on the GPU when this llama.cpp build can offload (a CUDA or Metal build), else 0."""
    return ALL_LAYERS if gpu_offload_supported() else 0


FINISH_REASONS = ("stop", "max_tokens", "context_full")


class EdgeSession:
    """Speculative chat: `EdgeSession().chat("hi")` uses the bundled default models locally.

    One request at a time: a session holds one conversation's KV caches. A request runs from the
    call of chat() (for a stream: from its first chunk) until its answer is complete, or the stream
    is exhausted, closed or garbage-collected. Meanwhile a request from another thread waits for
    its turn (requests are serialised), and one from the same thread, which could never get its
    turn (e.g. a second stream opened while the first is still being read), raises
    SessionBusyError. After close(), every call raises SessionClosedError; close() itself waits for
    the step in progress, and a request it cut short raises SessionClosedError at its next step.
    """

    def __init__(self, draft: str | os.PathLike = "draft", target: str | os.PathLike = "target", *,
                 verifier: str | Verifier | None = None, token: str | None = None, tls: None | bool | str = None,
                 local: bool = False, tree: TreeShape | None = None, n_ctx: int = 4096, fallback: bool = True,
                 deadline_s: float | None = None, probe_interval_s: float = 2.0, failure_threshold: int = 1,
                 on_switch: Callable[[SwitchEvent], None] | None = None, draft_threads: int | None = None,
                 target_threads: int | None = None, draft_gpu_layers: int | None = None,
                 target_gpu_layers: int | None = None, local_first: bool = False, lookup: bool = False,
                 experts: Sequence[Expert] = (), privacy: str | Masker | None = None, strict: bool = False,
                 pii_entities: Sequence[str] | None = None, session_id: str | None = None,
                 router: bool | str | os.PathLike | None = None) -> None:
        """Draft with `draft`; verify against `target` (manifest names, role aliases or GGUF paths).

        Where verification runs:
        - `local=True`: the target in this process (llama.cpp, no gRPC);
        - `verifier="host:port"`: a remote verifier service; `token` is its bearer token (default
          $EDGESPEC_TOKEN), `tls` True (system roots) or the path of a CA file to trust;
        - neither (the default): the bundled verifier service, started as a child process on
          loopback with the target model, and stopped by `close()`.
        A ready-made verifier object (the decoder's protocol: sync(context), verify(context, tree, ...),
        close(); see edgespec/edge/decoder.py) is used as given.
        A fleet of replicas, `verifier="h1:port,h2:port"` or `"fleet:NAME:PORT"` (every DNS record of
        NAME), is routed at the edge (edgespec/edge/fleet.py): sticky by rendezvous hashing of
        `session_id` (default: random per session), least-loaded placement, and a move with resync
        to another replica when this one fails.

        Fallback (remote and bundled modes; edgespec/edge/failover.py): the link is wrapped in a
        FailoverVerifier. A step the verifier does not answer within `deadline_s` (default 10 s;
        60 s with fallback=False), or that fails because the verifier is unreachable, is verified
        by this device's own copy of `target` instead, losslessly; `failure_threshold` consecutive
        failures open the circuit breaker (every step local), a probe every `probe_interval_s`
        re-attaches once the verifier is healthy. The local target is loaded lazily, at the first
        step that needs it (see LocalFallback for why), and never downloaded: without the file on
        this device, or with fallback=False, failures raise VerifierUnavailableError. A bundled
        verifier that dies is restarted by the probe (EmbeddedVerifier.ensure_running). Each switch
        is passed to `on_switch(SwitchEvent)`; state and counters are in stats.extra["failover"].
        A verifier that cannot be reached at all when the session starts (wrong address, port, TLS
        settings, token, model) raises here, naming the cause (VerifierConfigError, or the refusal's
        own error): fallback never hides a configuration mistake. `local_first=True` starts
        verifying locally instead, attaching the verifier once the probe reaches it. A verifier
        (or every replica of a fleet) that answers it is full (RESOURCE_EXHAUSTED) is not a
        configuration mistake: with a fallback the session starts locally the same way, without
        one it raises VerifierBusyError (FleetFullError for a fleet).

        Draft pool (edgespec/edge/pool): `lookup=True` adds a model-free lookup expert (the
        conversation so far) under the draft model, and `experts` adds any others (LoRA adapters,
        templates, more GGUF drafts); their trees are merged into one per step, exact under greedy
        and target-sample (the rejection rule drafts with the model alone). `self.pool` is the
        DraftPool (None without one): the router's handle (set_active, stats, report).

        Hardware: `draft_threads`/`target_threads` are llama.cpp threads of the draft and of this
        device's copy of the target (local mode, the bundled verifier, the fallback); None picks
        per mode (default_threads: remote mode gives the drafter every core but one, up to 8). `*_gpu_layers`
        offload layers to a GPU build of llama.cpp (-1: all); None: all layers when the build can
        offload, else none. `n_ctx` is the context window in tokens (prompt + answer); it must hold
        at least one step's tree, and an answer stops early (finish_reason "context_full") when
        the window is full.

        Router (edgespec/edge/router.py): `router=True` (state in $EDGESPEC_HOME/router/state.npz)
        or the path of its state file adds a lookup expert to the pool and lets the router choose,
        per turn, which of the pool's options drafts (the model, the lookup, the lookup under the
        model) and, per step, which tree, by predicted tokens per second: the expert's acceptance
        in this request's context (MiniLM embedding of the request and earlier user turns, learned
        from what the verifier accepted) against its drafting cost, the round trip and the
        verifier's cost per node (the planner's fits). What it learns is saved on close() and every
        32 steps, and adopted by the next session with the same state file. Needs the `router`
        extra and `edgespec models fetch router`; excludes a fixed `tree`. Lossless as any pool
        (under the sampled rejection rule only the model drafts). `self.router` is the Router.

        Privacy (edgespec/edge/privacy): `privacy="presidio"` (spaCy NER + pattern recognizers) or
        `"patterns"` masks personal values in every message (system, user, history, tool output)
        before it is tokenised, so the draft drafts on masked text and only masked tokens reach the
        verifier; answers are restored on this device, also when streaming. `strict=True` raises
        PrivacyError instead of falling back to patterns when the analyzer fails; `pii_entities`
        picks the entity types (default privacy.DEFAULT_ENTITIES). `self.privacy` is the Masker
        (its vault holds the mapping for the conversation, in memory only).
        """
        # PII masking (edgespec/edge/privacy): "presidio" | "patterns" | a Masker | None. First, so a
        # strict masker whose analyzer cannot load refuses before anything else happens.
        self.privacy = make_masker(privacy, strict=strict, entities=pii_entities)
        self._state = threading.Condition()   # guards the request/step/close bookkeeping below
        self._closed = False
        self._owner: int | None = None        # thread running the current request (or its latest step)
        self._stepping = False                # a step (native calls) is running
        self._free_after_step = False         # close() was called from inside a step
        self._resources_freed = False
        self.finish_reason: str | None = None  # why the last request ended: one of FINISH_REASONS
        if local and verifier is not None:
            raise InvalidRequestError("local=True and verifier=... exclude each other")
        # The router's parts that can fail (state path, embedding model) come before any model loads.
        router_state, embedder = None, None
        if router:
            if tree is not None:
                raise InvalidRequestError("router=... chooses every tree itself; it excludes a fixed `tree`")
            from edgespec.edge.embedding import Embedder
            from edgespec.edge.router import ROUTE_TOKENS, default_state_path

            router_state = default_state_path() if router is True else Path(router).expanduser()
            if router_state.is_dir():
                raise InvalidRequestError(f"router state {router_state} is a directory; give a file path")
            embedder = Embedder(max_tokens=ROUTE_TOKENS)
            lookup = True
        shapes = LADDER if tree is None else (tree,)
        nodes = tree_nodes_needed(shapes)
        if n_ctx < nodes + 1:
            raise InvalidRequestError(
                f"n_ctx={n_ctx} is too small: one step of this session's draft trees needs {nodes} KV cells, "
                f"so n_ctx must be at least {nodes + 1} plus room for the prompt and the answer "
                "(default 4096; a smaller fixed tree, e.g. a chain, needs less)")
        remote = verifier is not None and not local
        auto_draft, auto_target = default_threads(remote)
        draft_threads = auto_draft if draft_threads is None else draft_threads
        target_threads = auto_target if target_threads is None else target_threads
        for name, value in (("draft_threads", draft_threads), ("target_threads", target_threads)):
            if value < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {value}")
        for name, value in (("draft_gpu_layers", draft_gpu_layers), ("target_gpu_layers", target_gpu_layers)):
            if value is not None and value < ALL_LAYERS:
                raise InvalidRequestError(f"{name} must be >= 0 (or -1 for all layers), got {value}")
            if value and not gpu_offload_supported():
                raise InvalidRequestError(f"{name}={value} asks for a GPU, but this llama.cpp build cannot offload "
                                          "(rebuild it: EDGESPEC_LLAMA_FLAVOR=cuda tools/setup.sh, see README)")
        draft_gpu_layers = default_gpu_layers() if draft_gpu_layers is None else draft_gpu_layers
        target_gpu_layers = default_gpu_layers() if target_gpu_layers is None else target_gpu_layers
        self.threads = {"draft": draft_threads, "target": target_threads}
        self.gpu_layers = {"draft": draft_gpu_layers, "target": target_gpu_layers}
        self.n_ctx = n_ctx
        self.draft_model = LlamaModel(modelstore.resolve(draft), n_gpu_layers=draft_gpu_layers)
        config = ContextConfig(n_ctx=n_ctx, max_tree_nodes=nodes, n_threads=draft_threads)
        target_config = dataclasses.replace(config, n_threads=target_threads)
        self._max_tree_nodes = config.max_tree_nodes
        self.stats = SessionStats()
        self.target_model: LlamaModel | None = None
        self._embedded = None
        if local:
            self.target_model = LlamaModel(modelstore.resolve(target), n_gpu_layers=target_gpu_layers)
            if self.target_model.tokenizer_fingerprint() != self.draft_model.tokenizer_fingerprint():
                raise TokenizerMismatchError(
                    f"draft {self.draft_model.path.name} and target {self.target_model.path.name} have different "
                    "token lists; speculative decoding needs a draft with the target's tokenizer")
            verifier = LocalVerifier(self.target_model, target_config)
        elif verifier is None or isinstance(verifier, str):
            from edgespec.edge.link import expected_model_id

            address = verifier
            if address is None:  # the bundled verifier on loopback (token: random, per child)
                from edgespec.edge.embedded import EmbeddedVerifier

                # The child's limits must fit its n_ctx (it refuses larger ones); ours always do.
                self._embedded = EmbeddedVerifier(
                    modelstore.resolve(target), n_ctx=n_ctx,
                    max_nodes=min(255, max(128, nodes), n_ctx - 1),
                    max_depth=max(min(32, n_ctx - 2), *(s.max_depth for s in shapes)),
                    extra_args=["--threads", str(target_threads), "--n-gpu-layers", str(target_gpu_layers)])
                address, token, tls = self._embedded.address, self._embedded.token, None
            try:
                from edgespec.edge.failover import FailoverVerifier, LocalFallback

                fingerprint = self.draft_model.tokenizer_fingerprint()
                fallback_target, no_local = None, "fallback=False"
                if fallback:
                    fallback_target, no_local = LocalFallback.for_target(
                        target, tokenizer_hash=fingerprint, config=target_config,
                        max_depth=max(32, *(s.max_depth for s in shapes)), n_gpu_layers=target_gpu_layers)
                fleet_link, revive = None, None if self._embedded is None else self._embedded.ensure_running
                from edgespec.edge.fleet import is_fleet_spec
                if is_fleet_spec(address):
                    import uuid

                    from edgespec.edge.fleet import Fleet, FleetLink
                    fleet_link = FleetLink(
                        Fleet.shared(address, token=token or os.environ.get("EDGESPEC_TOKEN"), tls=tls),
                        session_id or uuid.uuid4().hex, tokenizer_hash=fingerprint,
                        model_id=expected_model_id(target), client_name="edgespec EdgeSession")
                    address, revive = fleet_link.address, fleet_link.revive
                verifier = FailoverVerifier(
                    address, token=token or os.environ.get("EDGESPEC_TOKEN"), tls=tls, tokenizer_hash=fingerprint,
                    model_id=expected_model_id(target), client_name="edgespec EdgeSession", local=fallback_target,
                    no_local_reason=no_local, deadline_s=deadline_s, probe_interval_s=probe_interval_s,
                    failure_threshold=failure_threshold, on_switch=on_switch, stats=lambda: self.stats,
                    revive=revive, local_first=local_first, link=fleet_link)
            except BaseException:
                if self._embedded is not None:
                    self._embedded.stop()
                raise
            self.stats.link = verifier.link_stats
        self.verifier = verifier
        self.drafter = Drafter(self.draft_model, config)
        self.pool: DraftPool | None = None
        if lookup or experts:
            from edgespec.edge.pool import DraftPool, LookupExpert, ModelExpert

            self.pool = DraftPool([ModelExpert.around("draft", self.drafter), *([LookupExpert()] if lookup else []),
                                   *experts], skip_models_at=SKIP_MODELS_AT if router else None)
        self.decoder = Decoder(self.pool or self.drafter, verifier, self.stats, tree, self.draft_model.is_end_of_generation,
                               pipelined=not local)
        self.router: Router | None = None
        self._routed: RoutedPlanner | None = None
        if router:
            from edgespec.edge.router import RoutedPlanner, Router, pool_arms

            self.router = Router(pool_arms(self.pool), embedder=embedder, state_path=router_state)
            self._routed = self.decoder.planner = RoutedPlanner(self.router, self.pool)

    def reset_stats(self) -> SessionStats:
        """Start counting afresh (e.g. per request); returns the statistics gathered so far."""
        old = self.stats
        self.stats = self.decoder.stats = SessionStats(link=old.link)
        return old

    @property
    def failover(self) -> "FailoverVerifier | None":
        """The fallback wrapper around the link (remote and bundled modes), else None."""
        from edgespec.edge.failover import FailoverVerifier

        return self.verifier if isinstance(self.verifier, FailoverVerifier) else None

    @property
    def embedded(self) -> "EmbeddedVerifier | None":
        """The bundled verifier child (default mode), else None."""
        return self._embedded

    @property
    def tree_shape(self) -> TreeShape | None:
        """The fixed tree shape, or None when the planner sizes each tree from the cost model."""
        return self.decoder.shape

    @tree_shape.setter
    def tree_shape(self, shape: TreeShape | None) -> None:
        """A fixed shape from now on, or None: a fresh planner sizes each tree."""
        nodes = tree_nodes_needed(LADDER if shape is None else (shape,))
        if nodes > self._max_tree_nodes:
            raise InvalidRequestError(f"tree shape {shape} needs up to {nodes} tree nodes; this session was "
                                      f"made for {self._max_tree_nodes} (pass a bigger `tree` at creation)")
        if shape is not None and self._routed is not None:
            raise InvalidRequestError("this session's router chooses every tree; a fixed shape excludes it")
        self.decoder.shape, self.decoder.planner = shape, (self._routed or Planner() if shape is None else None)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the session and free its models, KV caches and verifier (idempotent).

        A step running in another thread is finished first (native calls cannot be cut short);
        the request it belongs to then raises SessionClosedError, as does every later call.
        """
        me = threading.get_ident()
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.notify_all()          # requests waiting for their turn raise SessionClosedError
            if self._stepping and self._owner == me:  # e.g. an on_switch callback: free when the step ends
                self._free_after_step = True
                return
            while self._stepping:
                self._state.wait()
        self._free()

    def _free(self) -> None:
        with self._state:
            if self._resources_freed:
                return
            self._resources_freed = True
        try:
            self.decoder.close()               # waits for the verify thread
            self.verifier.close()
            if self.pool is not None:
                self.pool.close()              # the experts it loaded; the draft model's drafter is ours
            if self.router is not None:
                self.router.close()            # saves what it learned
            self.drafter.close()
        finally:
            try:
                if self._embedded is not None:
                    self._embedded.stop()
            finally:
                for model in (self.draft_model, self.target_model):
                    if model is not None:
                        model.close()

    # -- one request at a time ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this EdgeSession was closed; create a new one")

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the session for one request (see the class docstring: wait, or SessionBusyError)."""
        me = threading.get_ident()
        with self._state:
            while True:
                self._check_open()
                if self._owner is None:
                    break
                if self._owner == me:
                    raise SessionBusyError(
                        "this EdgeSession is already answering a request on this thread (an open stream): "
                        "read that stream to the end or close() it first, or use one session per conversation")
                self._state.wait()
            self._owner = me
        try:
            yield
        finally:
            with self._state:
                self._owner = None
                self._state.notify_all()

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """Native work of the current request; close() waits for it, and it refuses to start after close()."""
        with self._state:
            if self._closed:
                raise SessionClosedError("this EdgeSession was closed while answering; create a new one")
            self._stepping = True
            self._owner = threading.get_ident()   # whoever advances a stream owns it now
        try:
            yield
        finally:
            with self._state:
                self._stepping = False
                free, self._free_after_step = self._free_after_step, False
                self._state.notify_all()
            if free:
                self._free()

    def __enter__(self) -> "EdgeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: Messages, *, stream: bool = False, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             sampling_rule: AcceptanceRule | str = AcceptanceRule.TARGET_SAMPLE,
             banned_phrases: Sequence[str] = (),
             response_format: Mapping[str, Any] | Grammar | None = None) -> str | Iterator[str]:
        """Answer a prompt or a list of {"role", "content"} messages; stream=True yields text chunks.

        Sampling (temperature > 0) is exact whatever the tree: `sampling_rule` "target-sample"
        (default) or "rejection" (see common/acceptance.py). `seed` None draws a fresh seed per
        call, so the same prompt twice gives different answers; pass a seed to reproduce one.
        `banned_phrases` are never completed in the answer: their usual tokenisations are masked in
        the draft and in the verifier alike (common/constraints.py), so the output is the target's
        own output under that mask. `response_format` (OpenAI's: {"type": "json_schema",
        "json_schema": {"schema": {...}}}, {"type": "json_object"}; also {"type": "grammar",
        "grammar": LARK_OR_GBNF}, {"type": "regex", "regex": ...}) makes the answer match it: the
        same mask allows only the tokens that keep the answer a prefix of a match (then end of
        generation), so the output is the target's own constrained output. An answer cut short by
        max_tokens is an unfinished match. A `Grammar` already built from a response_format is used
        as it is (not compiled again).
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not any(m.get("content", "").strip() for m in messages):
            raise InvalidRequestError("the prompt is empty")
        if max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {max_tokens}")
        if seed is None:
            seed = secrets.randbits(63)
        constraint = None
        if banned_phrases:
            constraint = TokenConstraint.from_phrases(
                banned_phrases, lambda text: self.draft_model.tokenize(text, add_special=False, parse_special=False))
        grammar = (response_format if isinstance(response_format, Grammar) or response_format is None
                   else Grammar.from_response_format(response_format))
        if grammar is not None:
            constraint = dataclasses.replace(constraint or TokenConstraint(), grammar=grammar)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, rule=sampling_rule,
                                  constraint=constraint)
        self._check_open()
        messages = list(messages)
        if self.privacy is not None:   # everything tokenised (draft and verifier) is masked text
            messages = self.privacy.mask_messages(messages)
        turn = None
        if self._routed is not None:   # the request and the earlier user turns, most recent first
            users = [m.get("content", "") for m in messages if m.get("role", "user") == "user"]
            users = users or [messages[-1].get("content", "")]
            turn = (users[-1], users[-2::-1][:RECENT_TURNS])
        chunks = self._request(lambda: self.draft_model.chat_tokens(messages), max_tokens, sampling, as_text=True,
                               turn=turn)
        if self.privacy is not None:   # placeholders back to values, on this device only
            chunks = self.privacy.restore_stream(chunks)
        return chunks if stream else "".join(chunks)

    def generate_tokens(self, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Iterator[list[int]]:
        """The decode loop (edge/decoder.py); yields the tokens committed by each target step.
        One request like chat(): the same turn-taking, closing and context rules."""
        self._check_open()
        if self.privacy is not None:
            raise PrivacyError("PII masking is on: token prompts cannot be masked, use chat() with text")
        prompt = list(prompt)
        return self._request(lambda: prompt, max_tokens, sampling, as_text=False)

    def context_room(self, n_prompt: int) -> int:
        """Answer tokens that fit after a prompt of `n_prompt` tokens (the window minus what one
        step's drafting and verification may hold beyond the committed context)."""
        reserve = context_reserve(LADDER if self.decoder.shape is None else (self.decoder.shape,))
        return self.n_ctx - n_prompt - reserve

    def _route_turn(self, turn: tuple[str, Sequence[str]], sampling: SamplingParams) -> None:
        """The router picks this turn's drafting option (the decoder's planner is the RoutedPlanner).
        The sampled rejection rule needs one model's q: then only options the model drafts alone."""
        from edgespec.edge.pool.pool import MODEL_KINDS

        among = None
        if sampling.needs_q:
            among = [name for name, arm in self.router.arms.items()
                     if all(self.pool.expert(e).kind in MODEL_KINDS for e in arm.spec.experts)]
        self._routed.begin_turn(turn[0], turn[1], among=among)

    def _request(self, make_prompt: Callable[[], list[int]], max_tokens: int, sampling: SamplingParams,
                 as_text: bool, turn: tuple[str, Sequence[str]] | None = None) -> Iterator[Any]:
        """One request: text chunks (as_text) or the token lists of each target step.

        turn: (request, earlier user turns) for the router (default: the prompt's last tokens as text).

        Answers are capped to the room left in the context window, so drafting never runs past it;
        a verifier with a smaller window (remote) that overflows later ends the answer the same way.
        Either way the answer ends cleanly with finish_reason "context_full".
        """
        with self._turn():
            self.finish_reason = None
            with self._step():
                prompt = make_prompt()
                if sampling.constraint:   # a grammar starts at the answer, over the draft's token list
                    constraint = sampling.constraint.placed(len(prompt)).bind(self.draft_model.grammar_vocab)
                    sampling = dataclasses.replace(sampling, constraint=constraint)
                room = self.context_room(len(prompt))
                if room < 1:
                    raise ContextOverflowError(
                        f"the prompt has {len(prompt)} tokens, but with n_ctx={self.n_ctx} at most "
                        f"{len(prompt) + room - 1} fit (the rest is room for the draft trees): use a larger n_ctx "
                        "or a shorter prompt")
                limit = min(max_tokens, room)
                text = TextStream(self.draft_model) if as_text else None
                if self._routed is not None:   # token prompts: their last tokens as text (cut to ROUTE_TOKENS)
                    self._route_turn(turn or (self.draft_model.detokenize(prompt[-64:]), ()), sampling)
            steps = self.decoder.run(prompt, limit, sampling)
            produced, reason = 0, None
            try:
                while reason is None:
                    with self._step():
                        try:
                            tokens = next(steps, None)
                        except ContextOverflowError:
                            if not produced:   # the prompt itself does not fit the verifier
                                raise
                            tokens, reason = None, "context_full"
                        if tokens is None:
                            reason = reason or ("stop" if produced < limit else
                                                "max_tokens" if limit == max_tokens else "context_full")
                            out = text.flush() if text is not None else None
                        else:
                            produced += len(tokens)
                            out = text.push(tokens) if text is not None else tokens
                    if reason is not None:
                        self.finish_reason = reason
                    if out:
                        yield out
            finally:
                steps.close()
