"""Pattern recognizers: what a small NER model misses, in plain `re` plus checksums.

Pure Python (no presidio, no spaCy), so the pattern-only mode runs on devices that cannot hold a
spaCy model, and the presidio mode adds exactly these same recognizers to its NER.

No pattern uses `\\b` at its edges: after CJK text there is no word boundary ("密钥sk-..." must
match), so edges are explicit look-arounds on the characters that may not touch a value. A
look-behind stands after the value's first character or literal (`\\d(?<!\\d\\d)` for `(?<!\\d)\\d`,
the same matches): a pattern that starts with a character class or literal lets `re` skip ahead to
where it occurs, one that starts with a look-behind is tried at every position (2-5x slower; the e-mail
pattern, whose first class matches most characters, is the exception and keeps its look-behind first).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Span:
    """A detected value: text[start:end] is of type `entity`; `source` says which recognizer."""

    start: int
    end: int
    entity: str
    score: float = 1.0
    source: str = "pattern"


# Entity types, highest priority first: on overlap the higher type wins, whatever the scores (the
# small spaCy model tags IPs and phone numbers as DATE_TIME, and plain numbers as PERSON, with
# confident scores). Values already in the vault and user text shaped like a placeholder come first.
PRIORITY: tuple[str, ...] = (
    "PLACEHOLDER_LIKE", "KNOWN_VALUE", "API_KEY", "CN_RESIDENT_ID", "CREDIT_CARD", "IBAN_CODE", "EMAIL_ADDRESS",
    "US_SSN", "IP_ADDRESS", "PHONE_NUMBER", "ADDRESS", "PERSON", "LOCATION",
)

# What gets masked by default: every type above except LOCATION (a city in a question is rarely
# personal, and masking it costs answer quality); pass `entities=` to change it.
DEFAULT_ENTITIES: tuple[str, ...] = tuple(e for e in PRIORITY if e not in ("PLACEHOLDER_LIKE", "KNOWN_VALUE",
                                                                          "LOCATION"))


def luhn_ok(digits: str) -> bool:
    """Payment card checksum (ISO/IEC 7812)."""
    total, double = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if double:
            d = d * 2 - 9 if d > 4 else d * 2
        total, double = total + d, not double
    return total % 10 == 0


def iban_ok(value: str) -> bool:
    """ISO 13616 mod-97 check: country + check digits moved to the end, letters as 10..35."""
    s = value.replace(" ", "").upper()
    if not 15 <= len(s) <= 34 or not s[:2].isalpha() or not s[2:4].isdigit():
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def cn_resident_id_ok(value: str) -> bool:
    """GB 11643-1999: 17 digits, a valid birth date at 6..14, and the ISO 7064 MOD 11-2 check char."""
    v = value.upper()
    if len(v) != 18 or not v[:17].isdigit():
        return False
    year, month, day = int(v[6:10]), int(v[10:12]), int(v[12:14])
    if not (1900 <= year <= 2100 and 1 <= month <= 12 and 1 <= day <= 31):
        return False
    check = "10X98765432"[sum(int(c) * w for c, w in zip(v[:17], _ID_WEIGHTS)) % 11]
    return v[17] == check


def ip_ok(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def card_ok(value: str) -> bool:
    digits = re.sub(r"[ -]", "", value)
    return 13 <= len(digits) <= 19 and digits[0] in "3456" and luhn_ok(digits)


def ssn_ok(value: str) -> bool:
    area, group, serial = value.split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


@dataclass(frozen=True)
class PatternRecognizer:
    """One regex (group "v" is the value when present) and an optional validator of the value."""

    entity: str
    name: str
    regex: re.Pattern[str]
    validate: Callable[[str], bool] | None = None
    score: float = 1.0
    # A cheap test that is true of every text the regex can match in (a literal the match must
    # contain): texts without it skip the regex scan.
    needs: Callable[[str], bool] | None = None

    def find(self, text: str) -> Iterable[Span]:
        if self.needs is not None and not self.needs(text):
            return
        group = "v" if "v" in self.regex.groupindex else 0
        for m in self.regex.finditer(text):
            start, end = m.span(group)
            if start < 0 or start == end:
                continue
            value = text[start:end]
            if self.validate is None or self.validate(value):
                yield Span(start, end, self.entity, self.score, self.name)


_HAN = "\u4e00-\u9fff"
# Common Chinese surnames (the English spaCy model finds no Chinese names at all); a name is one of
# these plus one or two characters, and only next to a cue (我叫…, …先生), which keeps precision.
_SURNAMES = ("王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈"
             "姚卢姜崔钟谭陆汪范金石廖贾夏韦付方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤")
_NAME_END = r"(?=[\s，,。.;；:：、!！?？()（）的是在和与电手邮住身今明昨反说表]|$|\d)"
_NOT_CN_NAMES = {"方式", "方法", "方面", "方便", "高兴", "一下", "江湖", "万一"}  # surname-initial words after a cue
_STREET = r"(?:Street|St\.?|Avenue|Ave\.?|Road|Rd\.?|Boulevard|Blvd\.?|Lane|Ln\.?|Drive|Dr\.?|Way|Court|Ct\.?|Place|Pl\.?)"

RECOGNIZERS: tuple[PatternRecognizer, ...] = (
    PatternRecognizer("API_KEY", "openai_key", re.compile(r"sk-(?<![A-Za-z0-9_-]sk-)(?:proj-|ant-)?[A-Za-z0-9_-]{20,}")),
    PatternRecognizer("API_KEY", "github_token", re.compile(r"gh(?<![A-Za-z0-9_]gh)[pousr]_[A-Za-z0-9]{30,}")),
    PatternRecognizer("API_KEY", "aws_access_key", re.compile(r"A(?<![A-Z0-9]A)(?:KIA|SIA)[0-9A-Z]{16}(?![A-Z0-9])")),
    PatternRecognizer("API_KEY", "aws_secret_key", re.compile(
        r"(?i:aws_?secret(?:_?access)?_?key|secret access key)[\"']?\s*[:=]?\s*[\"']?(?P<v>[A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"),
        needs=lambda t: "secret" in t.casefold()),   # what (?i:) matches in "secret" (S, ſ) casefolds to it
    PatternRecognizer("API_KEY", "google_key", re.compile(r"AIza(?<![A-Za-z0-9_-]AIza)[0-9A-Za-z_-]{35}")),
    PatternRecognizer("API_KEY", "slack_token", re.compile(r"xox(?<![A-Za-z0-9]xox)[abprs]-[A-Za-z0-9-]{10,}")),
    PatternRecognizer("CN_RESIDENT_ID", "cn_resident_id", re.compile(r"\d(?<!\d\d)\d{16}[\dXx](?![\dA-Za-z])"),
                      cn_resident_id_ok),
    PatternRecognizer("CREDIT_CARD", "credit_card", re.compile(r"\d(?<![\d-]\d)(?:[ -]?\d){12,18}(?![\d-])"), card_ok),
    PatternRecognizer("IBAN_CODE", "iban", re.compile(
        r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?(?![A-Za-z0-9])"), iban_ok),
    PatternRecognizer("EMAIL_ADDRESS", "email", re.compile(
        r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")),
    PatternRecognizer("US_SSN", "us_ssn", re.compile(r"\d(?<![\d-]\d)\d{2}-\d{2}-\d{4}(?![\d-])"), ssn_ok),
    PatternRecognizer("IP_ADDRESS", "ipv4", re.compile(r"\d(?<![\d.]\d)\d{0,2}\.(?:\d{1,3}\.){2}\d{1,3}(?!\d|\.\d)"), ip_ok),
    PatternRecognizer("IP_ADDRESS", "ipv6", re.compile(
        r"(?<![0-9A-Fa-f:])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![0-9A-Fa-f:])"),
        lambda v: ":" in v and v.count(":") >= 2 and ip_ok(v)),
    PatternRecognizer("PHONE_NUMBER", "cn_mobile", re.compile(
        r"(?:\+(?<![\d+]\+)86[ -]?1|8(?<![\d+]8)6[ -]?1|1(?<![\d+]1))[3-9]\d[ -]?\d{4}[ -]?\d{4}(?!\d)")),
    PatternRecognizer("PHONE_NUMBER", "intl_phone", re.compile(r"\+(?<![\w+]\+)\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}(?!\d)"),
                      lambda v: 8 <= sum(c.isdigit() for c in v) <= 15),
    PatternRecognizer("PHONE_NUMBER", "nanp_phone", re.compile(
        r"(?:\((?<![\w+(]\()\d{3}|\d(?<![\w+(]\d)\d{2})\)?[ .-]\d{3}[ .-]\d{4}(?!\d)")),
    PatternRecognizer("ADDRESS", "street_address", re.compile(
        rf"\d(?<!\d\d)\d{{0,4}}\s+(?:[A-Z][a-z]+\s+){{1,3}}{_STREET}(?![A-Za-z])(?:,?\s+(?:Apt|Suite|Unit)\.?\s*#?\w+)?")),
    PatternRecognizer("ADDRESS", "cn_address", re.compile(
        rf"(?:住在|住址[:：]?|地址[:：是]?|位于|寄到|送到|搬到)?(?P<v>(?:[{_HAN}]{{2,4}}(?:省|自治区))?[{_HAN}]{{2,4}}市"
        rf"(?:[{_HAN}]{{2,4}}(?:区|县))?[{_HAN}]{{1,8}}?(?:路|街|大道|巷|胡同|道)\d+号(?:\d+(?:栋|幢|号楼|单元|室))*)"),
        needs=lambda t: "市" in t and "号" in t),
    # English names after a salutation, title or introduction: the small spaCy model reads "Dear John
    # Smith" as a WORK_OF_ART and misses it.
    PatternRecognizer("PERSON", "en_name_after_cue", re.compile(
        r"(?:\b(?:Dear|Mr\.?|Mrs\.?|Ms\.?|Miss|Dr\.?|Prof\.?|[Mm]y name is|I am|I'm|[Ss]igned:?|[Rr]egards,|"
        r"[Ss]incerely,|[Cc]ontact person:?|[Aa]ttn:?)\s+)(?P<v>[A-Z][a-z]+(?:[ -][A-Z][a-z]+){0,2})(?![A-Za-z])"),
        lambda v: v.split()[0] not in ("The", "A", "An", "Sir", "Madam", "All", "Team", "Customer", "Not", "Sorry",
                                        "Here", "Going", "Trying", "Looking", "Using", "Working")),
    PatternRecognizer("PERSON", "cn_name_before_cue", re.compile(
        rf"(?P<v>[{_SURNAMES}][{_HAN}]{{1,2}}?)(?:先生|女士|小姐|老师|医生|经理|同学|教授|律师|总)")),
    PatternRecognizer("PERSON", "cn_name_after_cue", re.compile(
        rf"(?:我叫|名叫|叫做|姓名[:：]?\s*|联系人[:：]?\s*|收件人[:：]?\s*|联系|客户|患者|员工|同事|朋友|致)"
        rf"(?P<v>[{_SURNAMES}][{_HAN}]{{1,2}}){_NAME_END}"), lambda v: v not in _NOT_CN_NAMES),
)


def find_all(text: str, entities: Iterable[str] | None = None) -> list[Span]:
    """Every pattern match of the wanted entity types (overlapping; `resolve` picks)."""
    wanted = None if entities is None else set(entities)
    return [s for r in RECOGNIZERS if wanted is None or r.entity in wanted for s in r.find(text)]


def resolve(spans: Iterable[Span]) -> list[Span]:
    """Non-overlapping spans, in text order: on overlap the higher-priority entity type wins; within
    a type the longer span, then the earlier one. Scores are never compared (see PRIORITY)."""
    rank = {e: i for i, e in enumerate(PRIORITY)}
    chosen: list[Span] = []
    for s in sorted(spans, key=lambda s: (rank.get(s.entity, len(rank)), -(s.end - s.start), s.start)):
        if all(s.end <= c.start or s.start >= c.end for c in chosen):
            chosen.append(s)
    return sorted(chosen, key=lambda s: s.start)
