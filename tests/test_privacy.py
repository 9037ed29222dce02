"""PII masking on the device (edgespec/edge/privacy): recognizers, priority, presidio's known false
positives, placeholders stable over a conversation, restoration (also streamed), strict mode, and
the vault staying in memory. Real presidio + spaCy, no mocks."""
from __future__ import annotations

import os
import stat

import pytest

from edgespec.edge.privacy import Masker, PrivacyError, Span, Vault
from edgespec.edge.privacy.patterns import card_ok, cn_resident_id_ok, find_all, iban_ok, resolve


@pytest.fixture(scope="module")
def presidio() -> Masker:
    return Masker("presidio", strict=True)


def masked_values(masker: Masker, text: str) -> dict[str, str]:
    """value -> entity for every span the masker would replace."""
    return {text[s.start:s.end]: s.entity for s in masker.detect(text)}


# -- pattern recognizers ----------------------------------------------------------------------
@pytest.mark.parametrize("text, value, entity", [
    ("key: sk-proj-abcDEF1234567890ghijKLMN", "sk-proj-abcDEF1234567890ghijKLMN", "API_KEY"),
    ("我的密钥sk-abc123def456ghi789jkl012mno请保密", "sk-abc123def456ghi789jkl012mno", "API_KEY"),  # no \b after CJK
    ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789 here", "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "API_KEY"),
    ("AWS AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE", "API_KEY"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     "API_KEY"),
    ("host 192.168.10.24 is down", "192.168.10.24", "IP_ADDRESS"),
    ("v6 2001:db8::8a2e:370:7334 up", "2001:db8::8a2e:370:7334", "IP_ADDRESS"),
    ("服务器地址10.0.0.7出错", "10.0.0.7", "IP_ADDRESS"),
    ("IBAN DE89 3704 0044 0532 0130 00.", "DE89 3704 0044 0532 0130 00", "IBAN_CODE"),
    ("GB82WEST12345698765432", "GB82WEST12345698765432", "IBAN_CODE"),
    ("card 4111 1111 1111 1111 exp", "4111 1111 1111 1111", "CREDIT_CARD"),
    ("卡号5500-0000-0000-0004", "5500-0000-0000-0004", "CREDIT_CARD"),
    ("mail li.na+work@mail.example.cn now", "li.na+work@mail.example.cn", "EMAIL_ADDRESS"),
    ("邮箱zhangwei@example.com。", "zhangwei@example.com", "EMAIL_ADDRESS"),
    ("电话13812345678", "13812345678", "PHONE_NUMBER"),
    ("手机 +86 139-1234-5678。", "+86 139-1234-5678", "PHONE_NUMBER"),
    ("call (415) 555-0132 today", "(415) 555-0132", "PHONE_NUMBER"),
    ("身份证号11010519491231002X。", "11010519491231002X", "CN_RESIDENT_ID"),
    ("SSN 123-45-6789", "123-45-6789", "US_SSN"),
    ("ship to 221 Baker Street, Apt 4", "221 Baker Street, Apt 4", "ADDRESS"),
    ("我住在北京市海淀区中关村大街27号。", "北京市海淀区中关村大街27号", "ADDRESS"),
    ("我叫李娜，你好", "李娜", "PERSON"),
    ("Repeat exactly: Dear John Smith, thanks", "John Smith", "PERSON"),   # spaCy sm: WORK_OF_ART
    ("Hello, my name is Anna Lee.", "Anna Lee", "PERSON"),
    ("请转告王伟先生", "王伟", "PERSON"),
])
def test_pattern_recognizers_find(text: str, value: str, entity: str) -> None:
    spans = resolve(find_all(text))
    assert {(text[s.start:s.end], s.entity) for s in spans} == {(value, entity)}


@pytest.mark.parametrize("text", [
    "card 4111 1111 1111 1112",            # Luhn fails
    "ID 110105194912310021",                # resident ID checksum fails
    "ID 110105194913310024",                # month 13
    "IBAN DE89 3704 0044 0532 0130 01",     # mod 97 fails
    "host 999.168.1.1",                     # not an IP
    "time 12:30:45 and version 1.2.3",      # not an IPv6 / IPv4
    "order 20240501 shipped",               # a plain number
    "SSN 000-12-3456",                      # invalid area
    "ABCDEFGHIJKL",                         # presidio's US driver-licence weak pattern matched this
])
def test_pattern_recognizers_reject(text: str) -> None:
    assert resolve(find_all(text)) == []


def test_checksums() -> None:
    assert card_ok("4012888888881881") and not card_ok("4012888888881882")
    assert cn_resident_id_ok("11010519491231002X") and cn_resident_id_ok("320106199003071234")
    assert iban_ok("FR1420041010050500013M02606") and not iban_ok("FR1420041010050500013M02607")


def test_overlaps_resolved_by_priority_not_score() -> None:
    # The small spaCy model calls phone numbers DATE_TIME/PERSON with confident scores.
    spans = [Span(0, 11, "PERSON", 0.99, "spacy"), Span(0, 11, "PHONE_NUMBER", 0.1), Span(3, 8, "LOCATION", 1.0)]
    assert resolve(spans) == [Span(0, 11, "PHONE_NUMBER", 0.1)]


# -- presidio with the small spaCy model ------------------------------------------------------
def test_presidio_finds_names_without_the_call_prefix(presidio: Masker) -> None:
    text = "Call John Smith at 13812345678 or 192.168.1.20."
    assert masked_values(presidio, text) == {"John Smith": "PERSON", "13812345678": "PHONE_NUMBER",
                                             "192.168.1.20": "IP_ADDRESS"}


def test_presidio_known_false_positives(presidio: Masker) -> None:
    # US driver-licence weak pattern: any 12 capital letters.
    assert masked_values(presidio, "The code is ABCDEFGHIJKL and XYZXYZXYZXYZ.") == {}
    # Numbers and log fragments tagged PERSON.
    log = "2024-05-01 12:00:03 ERROR worker-3 pid=4512 exited 137; retry 3 of 5 kube-proxy OOMKilled"
    assert all(e != "PERSON" for e in masked_values(presidio, log).values())
    assert masked_values(presidio, "Order 4512 and 7781 shipped, 12 items.") == {}


def test_presidio_all_caps_names(presidio: Masker) -> None:
    assert masked_values(presidio, "Signed: JOHN SMITH, account manager.") == {"JOHN SMITH": "PERSON"}
    assert "ERROR WORKER" not in masked_values(presidio, "ERROR WORKER FAILED at startup")


def test_a_chat_history_is_analysed_once(presidio: Masker) -> None:
    """Each turn re-sends the history: texts already analysed come from the analyzer's cache, so
    only new text pays for spaCy (docs/BENCHMARKS.md, per chat turn)."""
    history = [{"role": "user", "content": "Please write to John Smith about the invoice."},
               {"role": "assistant", "content": "Sure. Shall I copy Maria Garcia as well?"}]
    first = presidio.mask_messages(history)
    assert "John Smith" not in str(first) and "Maria Garcia" not in str(first)
    engine = presidio._ner.analyzer.nlp_engine
    nlp, engine.nlp = engine.nlp, {}   # the real engine, broken: any text it has to analyse fails
    try:
        assert presidio.mask_messages(history) == first
        with pytest.raises(PrivacyError, match="strict"):
            presidio.mask_messages([*history, {"role": "user", "content": "Yes, and Jane Doe too."}])
    finally:
        engine.nlp = nlp


def test_pass_through_context_enhancer_changes_nothing(presidio: Masker) -> None:
    """The analyzer skips presidio's lemma context enhancer (it only deep-copied results: our one
    recognizer has no context words); a stock engine over the same spaCy pipeline and recognizers
    must give the same results."""
    from presidio_analyzer import AnalyzerEngine

    ours = presidio._ner.analyzer
    assert not any(r.context for r in ours.registry.recognizers)
    stock = AnalyzerEngine(registry=ours.registry, nlp_engine=ours.nlp_engine, supported_languages=["en"])
    texts = ["Please write to John Smith in Berlin about the invoice; cc Maria Garcia (Paris office).",
             "Dear Dr. Priya Patel, your appointment in London moved. Regards, Daniel Okafor"]
    for text in texts:
        got = [(r.entity_type, r.start, r.end, r.score) for r in ours.analyze(text, language="en")]
        want = [(r.entity_type, r.start, r.end, r.score) for r in stock.analyze(text, language="en")]
        assert got == want and got


def test_spacy_wheel_without_gil_round_trips_in_the_ner_loop() -> None:
    """spaCy wheels from 3.8.7 on take and drop the GIL inside the NER's per-token loop (66 times per
    token in 3.8.7, ~450 from 3.8.8: 200-word prompt ~27 ms instead of ~16, docs/BENCHMARKS.md); the
    pins in pyproject.toml keep a wheel without it. Same .pyx sources, same detections."""
    spacy = pytest.importorskip("spacy")
    version = tuple(int(x) for x in spacy.__version__.split(".")[:3])
    assert (3, 8, 2) <= version < (3, 8, 7), f"spaCy {spacy.__version__}: see pyproject.toml, extra `privacy`"


def test_configurable_entities() -> None:
    masker = Masker("patterns", entities=["EMAIL_ADDRESS"])
    assert masker.mask("a@b.io 13812345678") == "[EMAIL_1] 13812345678"
    with pytest.raises(ValueError):
        Masker("patterns", entities=["SHOE_SIZE"])


# -- placeholders ------------------------------------------------------------------------------
def test_placeholders_typed_numbered_and_stable() -> None:
    masker = Masker("patterns")
    first = masker.mask("Mail a@x.io and b@x.io, phone 13812345678.")
    assert first == "Mail [EMAIL_1] and [EMAIL_2], phone [PHONE_1]."
    # Later turns (and the same number written differently) map to the same placeholders.
    assert masker.mask("Again b@x.io, 138 1234 5678, c@x.io") == "Again [EMAIL_2], [PHONE_1], [EMAIL_3]"
    messages = masker.mask_messages([{"role": "user", "content": "hi a@x.io"},
                                     {"role": "assistant", "content": "I wrote to a@x.io"}])
    assert [m["content"] for m in messages] == ["hi [EMAIL_1]", "I wrote to [EMAIL_1]"]


def test_known_values_masked_even_when_detection_would_miss_them(presidio: Masker) -> None:
    masker = Masker("presidio", vault=Vault())
    masker._ner = presidio._ner   # share the loaded spaCy pipeline
    assert masker.mask("Dear Maria Garcia,") == "Dear [PERSON_1],"
    # "garcia" alone in lower case is no name to NER; the full value reappearing is still masked.
    assert masker.mask("maria garcia? no: Maria Garcia.") == "maria garcia? no: [PERSON_1]."


def test_restore_round_trip_and_unknown_placeholders_untouched() -> None:
    masker = Masker("patterns")
    masked = masker.mask("Reach 13812345678 or a@x.io")
    answer = masked + " [PHONE_9] [EMAIL_1"
    assert masker.restore(answer) == "Reach 13812345678 or a@x.io [PHONE_9] [EMAIL_1"


def test_user_text_that_looks_like_a_placeholder_is_never_restored_into_a_value() -> None:
    masker = Masker("patterns")
    assert masker.mask("My e-mail is a@x.io") == "My e-mail is [EMAIL_1]"
    masked = masker.mask("Write the literal text [EMAIL_1] and [PHONE_1] in the template.")
    assert "[EMAIL_1]" not in masked and "[PHONE_1]" not in masked
    # The model echoes what it saw: the user's literals come back as literals, not as a@x.io.
    assert masker.restore(masked) == "Write the literal text [EMAIL_1] and [PHONE_1] in the template."
    assert masker.restore("[EMAIL_1]") == "a@x.io"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_restore_stream_holds_back_split_placeholders(size: int) -> None:
    masker = Masker("patterns")
    masked = masker.mask("Phone 13812345678, mail a@x.io, key sk-abcdefghijklmnopqrstuvwxyz, [brackets] [A_")
    answer = f"OK: {masked} then [PHONE_1]."
    chunks = [answer[i:i + size] for i in range(0, len(answer), size)]
    out = list(masker.restore_stream(iter(chunks)))
    assert "".join(out) == masker.restore(answer)
    assert "13812345678" in "".join(out) and not any("[PHONE" in c or "[EMAIL" in c for c in out)


def test_restore_stream_closes_its_source() -> None:
    closed = []

    def source():
        try:
            yield "a [PER"
            yield "SON_1] b"
        finally:
            closed.append(True)

    stream = Vault().restore_stream(source())
    assert next(stream) == "a "
    stream.close()
    assert closed == [True]


# -- failure modes and where the mapping lives ------------------------------------------------
def test_strict_mode_refuses_when_the_analyzer_cannot_load() -> None:
    with pytest.raises(PrivacyError, match="strict"):
        Masker("presidio", strict=True, spacy_model="en_core_web_not_installed")
    with pytest.warns(RuntimeWarning, match="pattern recognizers only"):
        lenient = Masker("presidio", spacy_model="en_core_web_not_installed")
    assert lenient.mode == "patterns" and lenient.mask("a@x.io") == "[EMAIL_1]"


def test_strict_mode_refuses_when_the_analyzer_fails() -> None:
    strict = Masker("presidio", strict=True)
    strict._ner.analyzer.nlp_engine.nlp = {}   # the real engine, broken: analyze() raises
    with pytest.raises(PrivacyError, match="strict"):
        strict.mask("John Smith, a@x.io")
    lenient = Masker("presidio", strict=False)
    lenient._ner.analyzer.nlp_engine.nlp = {}
    assert lenient.mask("John Smith, a@x.io") == "John Smith, [EMAIL_1]" and lenient.fallbacks == 1


def test_mapping_stays_in_memory_unless_saved(tmp_path, monkeypatch) -> None:
    for var in ("HOME", "TMPDIR", "EDGESPEC_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
        (tmp_path / var.lower()).mkdir()
    masker = Masker("patterns")
    secret = "sk-abcdefghijklmnopqrstuvwxyz123456"
    masker.restore(masker.mask(f"key {secret} mail zed@x.io"))
    assert secret not in repr(masker) and "zed@x.io" not in repr(masker.vault)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == []
    path = tmp_path / "vault.json"
    masker.vault.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Masker("patterns", vault=Vault.load(path))
    assert again.mask(f"{secret} and new@x.io") == "[API_KEY_1] and [EMAIL_2]"


def test_chinese_prompt_masked(presidio: Masker) -> None:
    text = "你好，我叫张伟，手机13912345678，邮箱zhang.wei@example.cn，身份证320106199003071234，住在上海市浦东新区世纪大道100号。"
    masked = presidio.mask(text)
    for value in ("张伟", "13912345678", "zhang.wei@example.cn", "320106199003071234", "上海市浦东新区世纪大道100号"):
        assert value not in masked
    assert presidio.restore(masked) == text
