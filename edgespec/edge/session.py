"""EdgeSession: the app-facing API. Drafts trees locally and has them verified.

The decode loop is deliberately small: sync -> grow a tree -> verify -> commit. The verifier is
anything with `sync(committed)`, `verify(tree, sampling, step)` and `close()`: the in-process
llama.cpp target (local mode) or the gRPC link to a verifier service.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from edgespec.common import modelstore
from edgespec.common.errors import InvalidRequestError, TokenizerMismatchError
from edgespec.common.sampling import SamplingParams
from edgespec.edge.decoder import Decoder, SessionStats, Verifier
from edgespec.edge.drafting import Drafter, TreeShape
from edgespec.edge.planner import LADDER, Planner
from edgespec.runtime.llama import ContextConfig, LlamaModel, TextStream
from edgespec.runtime.tree_verifier import LocalVerifier

if TYPE_CHECKING:
    from edgespec.edge.embedded import EmbeddedVerifier
    from edgespec.edge.failover import FailoverVerifier, SwitchEvent

Messages = str | Sequence[dict[str, str]]


def tree_nodes_needed(shapes: Sequence[TreeShape]) -> int:
    """KV rows one step may need: the root plus the larger of the frontier decodes and the budget."""
    return max(max(s.width * s.max_depth, s.budget) for s in shapes) + 1


class EdgeSession:
    """Speculative chat: `EdgeSession().chat("hi")` uses the bundled default models locally."""

    def __init__(self, draft: str | os.PathLike = "draft", target: str | os.PathLike = "target", *,
                 verifier: str | Verifier | None = None, token: str | None = None, tls: None | bool | str = None,
                 local: bool = False, tree: TreeShape | None = None, n_ctx: int = 4096, fallback: bool = True,
                 deadline_s: float | None = None, probe_interval_s: float = 2.0, failure_threshold: int = 1,
                 on_switch: Callable[[SwitchEvent], None] | None = None, local_first: bool = False) -> None:
        """Draft with `draft`; verify against `target` (manifest names, role aliases or GGUF paths).

        Where verification runs:
        - `local=True`: the target in this process (llama.cpp, no gRPC);
        - `verifier="host:port"`: a remote verifier service; `token` is its bearer token (default
          $EDGESPEC_TOKEN), `tls` True (system roots) or the path of a CA file to trust;
        - neither (the default): the bundled verifier service, started as a child process on
          loopback with the target model, and stopped by `close()`.
        A ready-made verifier object (the decoder's protocol: sync(context), verify(context, tree, ...),
        close(); see edgespec/edge/decoder.py) is used as given.

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
        verifying locally instead, attaching the verifier once the probe reaches it.
        """
        if local and verifier is not None:
            raise InvalidRequestError("local=True and verifier=... exclude each other")
        self.draft_model = LlamaModel(modelstore.resolve(draft))
        shapes = LADDER if tree is None else (tree,)
        config = ContextConfig(n_ctx=n_ctx, max_tree_nodes=tree_nodes_needed(shapes))
        self._max_tree_nodes = config.max_tree_nodes
        self.stats = SessionStats()
        self.target_model: LlamaModel | None = None
        self._embedded = None
        if local:
            self.target_model = LlamaModel(modelstore.resolve(target))
            if self.target_model.tokenizer_fingerprint() != self.draft_model.tokenizer_fingerprint():
                raise TokenizerMismatchError(
                    f"draft {self.draft_model.path.name} and target {self.target_model.path.name} have different "
                    "token lists; speculative decoding needs a draft with the target's tokenizer")
            verifier = LocalVerifier(self.target_model, config)
        elif verifier is None or isinstance(verifier, str):
            from edgespec.edge.link import expected_model_id

            address = verifier
            if address is None:  # the bundled verifier on loopback (token: random, per child)
                from edgespec.edge.embedded import EmbeddedVerifier

                self._embedded = EmbeddedVerifier(modelstore.resolve(target), n_ctx=n_ctx,
                                                  max_nodes=min(255, max(128, config.max_tree_nodes)),
                                                  max_depth=max(32, *(s.max_depth for s in shapes)))
                address, token, tls = self._embedded.address, self._embedded.token, None
            try:
                from edgespec.edge.failover import FailoverVerifier, LocalFallback

                fingerprint = self.draft_model.tokenizer_fingerprint()
                fallback_target, no_local = None, "fallback=False"
                if fallback:
                    fallback_target, no_local = LocalFallback.for_target(
                        target, tokenizer_hash=fingerprint, config=config,
                        max_depth=max(32, *(s.max_depth for s in shapes)))
                verifier = FailoverVerifier(
                    address, token=token or os.environ.get("EDGESPEC_TOKEN"), tls=tls, tokenizer_hash=fingerprint,
                    model_id=expected_model_id(target), client_name="edgespec EdgeSession", local=fallback_target,
                    no_local_reason=no_local, deadline_s=deadline_s, probe_interval_s=probe_interval_s,
                    failure_threshold=failure_threshold, on_switch=on_switch, stats=lambda: self.stats,
                    revive=None if self._embedded is None else self._embedded.ensure_running, local_first=local_first)
            except BaseException:
                if self._embedded is not None:
                    self._embedded.stop()
                raise
            self.stats.link = verifier.link_stats
        self.verifier = verifier
        self.drafter = Drafter(self.draft_model, config)
        self.decoder = Decoder(self.drafter, verifier, self.stats, tree, self.draft_model.is_end_of_generation,
                               pipelined=not local)

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
        self.decoder.shape, self.decoder.planner = shape, (Planner() if shape is None else None)

    def close(self) -> None:
        try:
            self.decoder.close()
            self.verifier.close()
            self.drafter.close()
        finally:
            if self._embedded is not None:
                self._embedded.stop()

    def __enter__(self) -> "EdgeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: Messages, *, stream: bool = False, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> str | Iterator[str]:
        """Answer a prompt or a list of {"role", "content"} messages; stream=True yields text chunks."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not any(m.get("content", "").strip() for m in messages):
            raise InvalidRequestError("the prompt is empty")
        if max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {max_tokens}")
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        prompt = self.draft_model.chat_tokens(list(messages))
        chunks = self._stream_text(prompt, max_tokens, sampling)
        return chunks if stream else "".join(chunks)

    def generate_tokens(self, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Iterator[list[int]]:
        """The decode loop (edge/decoder.py); yields the tokens committed by each target step."""
        return self.decoder.run(prompt, max_tokens, sampling)

    def _stream_text(self, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> Iterator[str]:
        text = TextStream(self.draft_model)
        for tokens in self.generate_tokens(prompt, max_tokens, sampling):
            chunk = text.push(tokens)
            if chunk:
                yield chunk
        tail = text.flush()
        if tail:
            yield tail
