"""The draft pool (edgespec/edge/pool): lookup, templates, merging, memory budget, LoRA hot-swap, and
losslessness of merged trees through the real decoder (greedy on llama.cpp with SmolLM2; sampled by
chi-square over the table models of test_sampling_pipeline.py)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgespec.common.errors import InvalidRequestError
from edgespec.common.sampling import AcceptanceRule, SamplingParams
from edgespec.common.tree import TokenTree
from edgespec.edge.decoder import Decoder, SessionStats
from edgespec.edge.drafting import Draft, Drafter, TreeShape
from edgespec.edge.pool import (
    DraftPool,
    LoraExpert,
    LookupExpert,
    ModelExpert,
    PoolMemoryError,
    SuffixIndex,
    TemplateExpert,
    merge_drafts,
)
from edgespec.runtime.llama import ContextConfig, TreeContext
from edgespec.runtime.lora import LoraAdapter, set_adapters
from edgespec.runtime.tree_verifier import LocalVerifier
from lossless import assert_lossless, target_only_greedy
from test_sampling_pipeline import (
    EMITTED,
    PROMPT,
    TableDraftContext,
    TableModel,
    TableVerifier,
    chi2_pvalue,
    exact_distribution,
)

GREEDY = SamplingParams()
SHAPE = TreeShape(budget=12, max_depth=6, branching=2, width=2)


# -- lookup ---------------------------------------------------------------------------------------
def test_lookup_drafts_what_followed_the_repeated_text():
    sentence = [5, 6, 7, 8, 9, 10, 11, 12]
    committed = [1, 2, *sentence, 3, 4, 5, 6, 7]          # the sentence starts again
    expert = LookupExpert(min_n=2)
    draft = expert.propose(committed, TreeShape(budget=8, max_depth=4), GREEDY, 0)
    draft.tree.validate(vocab_size=100)
    assert draft.tree.tokens[draft.tree.path_to(len(draft.tree) - 1)].tolist() == [8, 9, 10, 11]
    assert draft.scores[1] > draft.scores[-1] > 0
    assert expert.predict_next(committed) == 8


def test_lookup_branches_by_frequency_and_reads_the_corpus():
    expert = LookupExpert(min_n=2)
    expert.add_document([40, 41, 50, 51])                  # a file the answer may quote
    committed = [40, 41, 60, 9, 40, 41, 60, 8, 40, 41]     # "40 41" went on with 60 twice, with 50 once
    draft = expert.propose(committed, TreeShape(budget=8, max_depth=2), GREEDY, 0)
    first = {int(draft.tree.tokens[c]): draft.scores[c] for c in draft.tree.children()[0]}
    assert set(first) == {60, 50} and first[60] > first[50]


def test_suffix_index_stays_exact_when_guesses_are_taken_back():
    """Drafting ahead syncs the index to guessed contexts; dropping them must leave exactly the
    index of the real context (as if built from scratch), or lookups would quote wrong guesses."""
    rng = np.random.default_rng(0)
    index = SuffixIndex(max_n=4)
    real = rng.integers(0, 5, 40).tolist()
    for cut in range(10, 40, 3):
        index.sync_conversation(real[:cut] + rng.integers(0, 5, 4).tolist())   # a wrong guess
        index.sync_conversation(real[:cut])
    fresh = SuffixIndex(max_n=4)
    fresh.sync_conversation(real[:37])
    assert dict(index._table) == dict(fresh._table)
    index.sync_conversation([4, 4, 4] + real)             # a new conversation: the old one joins the corpus
    assert len(index.docs) == 2 and index.docs[1] == real[:37]


# -- templates ------------------------------------------------------------------------------------
def test_template_proposes_the_tool_call_structure(smol_model):
    expert = TemplateExpert.for_model(smol_model, tools=["get_weather"])
    committed = smol_model.tokenize("I will call a tool.\n<tool_call>\n", add_special=False)
    draft = expert.propose(committed, TreeShape(budget=16, max_depth=12), GREEDY, 0)
    draft.tree.validate(smol_model.n_vocab)
    texts = {smol_model.detokenize(draft.tree.tokens[draft.tree.path_to(leaf)].tolist()) for leaf in draft.tree.leaves()}
    assert '{"name": "' in texts
    committed = smol_model.tokenize('<tool_call>\n{"name": "', add_special=False)
    draft = expert.propose(committed, TreeShape(budget=16, max_depth=12), GREEDY, 0)
    texts = {smol_model.detokenize(draft.tree.tokens[draft.tree.path_to(leaf)].tolist()) for leaf in draft.tree.leaves()}
    assert 'get_weather", "arguments": {"' in texts
    assert len(expert.propose(smol_model.tokenize("Hello there", add_special=False), SHAPE, GREEDY, 0).tree) == 1


# -- merging --------------------------------------------------------------------------------------
def _draft(root: int, chains: list[list[int]], score: float, decoded: bool) -> Draft:
    """A prefix-shared tree of `chains`; node scores score**depth (decoded: every node has a KV seq)."""
    tokens, parents, index = [root], [-1], {}
    for chain in chains:
        node = 0
        for t in chain:
            if (node, t) not in index:
                index[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = index[(node, t)]
    tree = TokenTree(tokens=np.array(tokens), parents=np.array(parents))
    return Draft(tree, [0] + [(i if decoded else -1) for i in range(1, len(tokens))], score ** tree.depths.astype(float))


def test_merged_tree_dedups_prefixes_and_shares_the_budget_by_score():
    model = _draft(1, [[2, 3, 4], [2, 5], [6]], 0.6, decoded=True)
    lookup = _draft(1, [[2, 3, 7, 8, 9], [10]], 0.9, decoded=False)
    merged = merge_drafts([("lookup", lookup), ("model", model)], budget=6)
    tree, draft = merged.draft.tree, merged.draft
    tree.validate(vocab_size=100)
    assert len(tree) == 7 and not draft.prefix_groups
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    paths = {tuple(tree.tokens[tree.path_to(i)].tolist()): i for i in range(1, len(tree))}
    assert (2,) in paths and (2, 3) in paths                        # shared prefix, once
    both = paths[(2, 3)]
    assert merged.origins[both] == {"model", "lookup"} and draft.scores[both] == pytest.approx(0.81)
    assert draft.node_seq[both] >= 0                                 # the model decoded it
    assert draft.node_seq[paths[(2, 3, 7)]] == -1                    # only the lookup proposed it
    kept_scores = sorted(draft.scores[1:], reverse=True)
    assert min(kept_scores) >= 0.6 ** 2                              # the weakest candidates were cut


# -- losslessness through the real decoder --------------------------------------------------------
REPEAT_PROMPT = ("Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates, limes, "
                 "grapes, melons, kiwis.")


@pytest.mark.parametrize("pipelined,skip", [(False, None), (True, 1.5)], ids=["step", "pipelined-skipping"])
def test_pool_greedy_output_equals_target_only(smol_model, pipelined, skip):
    """Model + lookup + templates merged, SmolLM2 as draft and target: the target's own greedy output.
    With skipping, some steps send the lookup's tree alone (the model's KV catches up later)."""
    prompt = smol_model.chat_tokens([{"role": "user", "content": REPEAT_PROMPT}])
    n = 48
    ref = target_only_greedy(smol_model, prompt, n)
    config = ContextConfig(n_ctx=1024, max_tree_nodes=64)
    drafter = Drafter(smol_model, config)
    pool = DraftPool([ModelExpert.around("draft", drafter), LookupExpert(), TemplateExpert.for_model(smol_model)],
                     skip_models_at=skip)
    verifier = LocalVerifier(smol_model, config)
    decoder = Decoder(pool, verifier, SessionStats(), SHAPE, smol_model.is_end_of_generation, pipelined=pipelined)
    try:
        out = [t for chunk in decoder.run(prompt, n, GREEDY) for t in chunk]
    finally:
        decoder.close()
        verifier.close()
        pool.close()
        drafter.close()
    out = out + [smol_model.eos] if len(out) < n else out
    assert_lossless(out, ref, f"pool-{pipelined}")
    assert pool.merged_steps > 0 and pool.stats()["lookup"].sent > 0   # lookup nodes were really sent
    assert pool.stats()["lookup"].opportunities > 0
    assert (pool.skipped_model_proposals > 0) == (skip is not None)


class OtherTableContext(TableDraftContext):
    """A second table 'model' (a different draft distribution), for a pool of two model experts."""

    def sync(self, tokens):
        return super().sync(tokens)[::-1].copy()

    def decode_frontier(self, tokens, parent_seqs, depth, first_seq):
        return super().decode_frontier(tokens, parent_seqs, depth, first_seq)[:, ::-1].copy()


def table_pool() -> DraftPool:
    return DraftPool([
        ModelExpert.around("table", Drafter(TableModel(), context=TableDraftContext())),   # type: ignore[arg-type]
        ModelExpert.around("other", Drafter(TableModel(), context=OtherTableContext())),   # type: ignore[arg-type]
        LookupExpert(min_n=1)])


@pytest.mark.parametrize("rule", list(AcceptanceRule), ids=lambda r: r.value)
def test_pool_sampled_output_has_the_target_distribution(rule):
    """Merged trees (two table models + lookup) under target-sample, and the model alone under the
    rejection rule, through the real Decoder: chi-square against exact target sampling."""
    pool = table_pool()
    decoder = Decoder(pool, TableVerifier(), SessionStats(), TreeShape(budget=8, max_depth=3, branching=2, width=2),
                      lambda t: False, pipelined=False)
    counts: dict[tuple[int, ...], int] = {}
    runs = 2500
    try:
        for seed in range(runs):
            sampling = SamplingParams(temperature=1.0, seed=20_000 + seed, rule=rule)
            # (the lookup proposes from the second step on, once the context repeats a token)
            out = [t for chunk in decoder.run(list(PROMPT), EMITTED, sampling) for t in chunk][:EMITTED]
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    finally:
        decoder.close()
    assert chi2_pvalue(counts, exact_distribution(SamplingParams(temperature=1.0))) > 1e-4
    assert decoder.stats.accepted > 0
    if rule is AcceptanceRule.TARGET_SAMPLE:
        assert pool.merged_steps > runs / 4 and pool.stats()["lookup"].sent > 0
    else:
        assert pool.merged_steps == 0 and pool.stats()["other"].proposals == 0


def test_rejection_rule_without_a_model_expert_is_refused():
    pool = DraftPool([LookupExpert(min_n=1)])
    with pytest.raises(InvalidRequestError, match="rejection rule"):
        pool.grow([0, 1, 0, 1], SHAPE, SamplingParams(temperature=1.0, rule=AcceptanceRule.REJECTION), 0)
    assert len(pool.grow([0, 1, 0, 1], SHAPE, SamplingParams(temperature=1.0), 0).tree) > 1
    pool = table_pool()
    pool.set_active(["lookup"])                           # the rejection rule still drafts with the model alone
    draft = pool.grow([0, 1, 0, 1], SHAPE, SamplingParams(temperature=1.0, rule=AcceptanceRule.REJECTION), 0)
    assert draft.prefix_groups and draft.tree.q_tokens.shape[1] > 0 and pool.stats()["lookup"].proposals == 0


def test_model_experts_are_skipped_when_the_lookup_promises_enough():
    pool = table_pool()
    pool.skip_models_at = 0.9                             # the lookup scores 0.5 + 0.25 + 0.125 + 0.0625 here
    shape = TreeShape(budget=8, max_depth=4, branching=2, width=2)
    repeated = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    draft = pool.grow(repeated, shape, GREEDY, 0)
    assert pool.stats()["table"].proposals == 0 and pool.skipped_model_proposals == 2
    assert draft.tree.tokens[draft.tree.path_to(len(draft.tree) - 1)].tolist() == [3, 4, 5, 0]
    pool = table_pool()
    pool.skip_models_at = 0.9
    pool.grow([0, 1, 2], shape, GREEDY, 1)                # nothing to look up: the models draft
    assert pool.stats()["table"].proposals == 1 and pool.stats()["other"].proposals == 1


# -- memory budget and LRU ------------------------------------------------------------------------
def test_pool_loads_lazily_and_evicts_the_least_recently_used(smol_path):
    config = ContextConfig(n_ctx=256, max_tree_nodes=16)
    a, b = ModelExpert.from_path("a", smol_path, config), ModelExpert.from_path("b", smol_path, config)
    one = a.estimated_bytes()
    pool = DraftPool([a, b, LookupExpert()], memory_budget=int(1.5 * one), active=["a", "lookup"])
    try:
        assert not a.loaded() and not b.loaded()                         # nothing loaded before it is needed
        committed = [1, 2, 3]
        pool.grow(committed, SHAPE, GREEDY, 0)
        assert a.loaded() and not b.loaded()
        pool.set_active(["b", "lookup"])
        pool.grow(committed, SHAPE, GREEDY, 1)
        assert b.loaded() and not a.loaded()                             # a was evicted to make room
        assert pool.resident_bytes() <= pool.memory_budget
        report = {r["name"]: r for r in pool.report()}
        assert "evicted" in report["a"]["why"] and report["b"]["resident"] and report["lookup"]["resident"]
        pool.set_active(["a", "b"])
        with pytest.raises(PoolMemoryError, match="budget"):
            pool.grow(committed, SHAPE, GREEDY, 2)
    finally:
        pool.close()


# -- LoRA adapters --------------------------------------------------------------------------------
def write_random_lora(path: Path, base: Path, rank: int = 4, seed: int = 0, std: float = 0.05) -> Path:
    """A tiny random LoRA (attn_q and attn_v of every block) for the base GGUF, written with gguf."""
    reader = gguf.GGUFReader(str(base))
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        if t.name.endswith(("attn_q.weight", "attn_v.weight")):
            n_in, n_out = int(t.shape[0]), int(t.shape[1])     # ggml order: ne0 = input features
            writer.add_tensor(t.name + ".lora_a", rng.normal(0, std, (rank, n_in)).astype(np.float32))
            writer.add_tensor(t.name + ".lora_b", rng.normal(0, std, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def loras(smol_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return write_random_lora(root / "a.gguf", smol_path, seed=1), write_random_lora(root / "b.gguf", smol_path, seed=2)


def test_adapter_switch_changes_logits_and_switching_back_restores_them_bit_for_bit(smol_model, loras):
    ctx = TreeContext(smol_model, ContextConfig(n_ctx=256, max_tree_nodes=16))
    adapter = LoraAdapter(smol_model, loras[0])
    tokens = smol_model.tokenize("The quick brown fox jumps over the lazy dog.")
    try:
        plain = ctx.sync(tokens).copy()
        set_adapters(ctx, [(adapter, 1.0)])
        adapted = ctx.sync(tokens).copy()
        set_adapters(ctx, [])
        again = ctx.sync(tokens).copy()
        set_adapters(ctx, [(adapter, 1.0)])
        adapted_again = ctx.sync(tokens).copy()
    finally:
        ctx.close()
        adapter.close()
    assert np.abs(adapted - plain).max() > 0.1
    assert np.array_equal(plain, again) and np.array_equal(adapted, adapted_again)


def test_lora_experts_share_the_base_and_hot_swap(smol_path, loras):
    config = ContextConfig(n_ctx=256, max_tree_nodes=16)
    base = ModelExpert.from_path("base", smol_path, config)
    lora = LoraExpert("lora", base, loras[0], config=config)
    pool = DraftPool([base, lora], active=["lora"])
    committed = list(range(300, 340))
    shape = TreeShape(budget=8, max_depth=3, branching=2, width=2)
    try:
        tuned = pool.grow(committed, shape, GREEDY, 0)
        assert base.loaded() and lora.drafter.model is base.drafter.model   # loaded once, shared
        report = {r["name"]: r for r in pool.report()}
        assert report["base"]["why"].startswith("base of lora")
        pool.set_active(["base"])
        plain = pool.grow(committed, shape, GREEDY, 1)
        assert not np.allclose(tuned.scores, plain.scores)
        assert lora.swap(loras[1]) == loras[0]                               # new version, no base reload
        pool.set_active(["lora"])
        other = pool.grow(committed, shape, GREEDY, 2)
        assert not np.allclose(other.scores, tuned.scores)
        lora.swap(loras[0])                                                  # roll back
        back = pool.grow(committed, shape, GREEDY, 3)
        assert np.array_equal(back.tree.tokens, tuned.tree.tokens) and np.array_equal(back.scores, tuned.scores)
        lora.swap(None)                                                      # bare base through the LoRA slot
        bare = pool.grow(committed, shape, GREEDY, 4)
        assert np.array_equal(bare.tree.tokens, plain.tree.tokens) and np.array_equal(bare.scores, plain.scores)
    finally:
        pool.close()


def test_budget_counts_every_adapter_and_eviction_takes_dependents_with_the_base(smol_path, loras):
    config = ContextConfig(n_ctx=256, max_tree_nodes=16)
    base = ModelExpert.from_path("base", smol_path, config)
    other = ModelExpert.from_path("other", smol_path, config)
    lora = LoraExpert("lora", base, loras[0], config=config)
    pool = DraftPool([base, lora, other], memory_budget=int(1.5 * base.estimated_bytes()), active=["lora"])
    try:
        pool.grow(list(range(300, 310)), SHAPE, GREEDY, 0)
        assert base.loaded() and lora.loaded()
        pool.set_active(["other"])
        pool.grow(list(range(300, 310)), SHAPE, GREEDY, 1)
        assert other.loaded() and not base.loaded() and not lora.loaded()
    finally:
        pool.close()


# -- EdgeSession wiring ---------------------------------------------------------------------------
def test_session_with_lookup_is_lossless_and_frees_the_pool(smol_path, smol_model):
    from edgespec import EdgeSession
    from lossless import spec_tokens

    with EdgeSession(smol_path, smol_path, local=True, tree=SHAPE, n_ctx=1024, lookup=True,
                     experts=[TemplateExpert.for_model(smol_model)]) as session:
        prompt = session.draft_model.chat_tokens([{"role": "user", "content": REPEAT_PROMPT}])
        ref = target_only_greedy(smol_model, prompt, 40)
        assert_lossless(spec_tokens(session, prompt, 40), ref, "session-lookup")
        assert [r["name"] for r in session.pool.report()] == ["draft", "lookup", "template"]
        assert session.pool.stats()["lookup"].proposals > 0
    assert session.drafter.ctx.closed
