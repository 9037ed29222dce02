"""Build tests/data/pii_labelled.jsonl: a labelled PII set (English and Chinese) for tools/bench_privacy.py.

Seeded and deterministic: `python tools/pii_dataset.py` rewrites the same file. Each line is
{"lang", "text", "entities": [{"start", "end", "type", "value"}]}. Templates are written to be
varied rather than easy: names in lower case and without cues, Chinese names without a cue word,
numbers in several formats, addresses in prose, and texts with no PII at all (log lines, code,
order numbers, dates), so that neither recall nor precision is 1 by construction. Checksummed
values (cards, IBANs, resident IDs) are valid; a few invalid ones appear as non-PII distractors.
"""
from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "pii_labelled.jsonl"
EN_FIRST = ["John", "Maria", "Ahmed", "Priya", "Lucas", "Emily", "Kenji", "Olga", "Daniel", "Fatima", "Liam", "Sofia"]
EN_LAST = ["Smith", "Garcia", "Khan", "Patel", "Martin", "Brown", "Tanaka", "Ivanova", "Okafor", "Rossi", "Nguyen"]
ZH_NAMES = ["张伟", "王芳", "李娜", "刘洋", "陈静", "杨磊", "赵敏", "黄晓明", "周杰", "吴桐", "徐静蕾", "孙立"]
STREETS = ["Baker Street", "Main Street", "Elm Avenue", "Oak Road", "Sunset Boulevard", "Maple Lane", "Park Drive"]
ZH_ADDR = ["北京市海淀区中关村大街27号", "上海市浦东新区世纪大道100号", "广东省深圳市南山区科技园路8号",
           "浙江省杭州市西湖区文三路90号", "四川省成都市武侯区人民南路4号"]
DOMAINS = ["example.com", "mail.example.org", "corp.example.net", "example.cn"]


def luhn_complete(prefix: str, length: int, rng: random.Random) -> str:
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch)
        if i % 2 == 0:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return body + str((10 - total % 10) % 10)


def card(rng: random.Random) -> str:
    digits = luhn_complete(rng.choice(["4", "51", "55", "37"]), 16, rng)
    return rng.choice([digits, " ".join(digits[i:i + 4] for i in range(0, 16, 4)),
                       "-".join(digits[i:i + 4] for i in range(0, 16, 4))])


def iban(rng: random.Random) -> str:
    bban = "".join(rng.choice(string.digits) for _ in range(18))
    country = "DE"
    check = 98 - int("".join(str(int(c, 36)) for c in bban + country + "00")) % 97
    value = f"{country}{check:02d}{bban}"
    return rng.choice([value, " ".join(value[i:i + 4] for i in range(0, len(value), 4))])


def cn_id(rng: random.Random) -> str:
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    body = (rng.choice(["110105", "310115", "440305", "510107"]) + str(rng.randint(1960, 2004))
            + f"{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}" + f"{rng.randint(0, 999):03d}")
    return body + "10X98765432"[sum(int(c) * w for c, w in zip(body, weights)) % 11]


def cn_mobile(rng: random.Random) -> str:
    n = "1" + rng.choice("3456789") + "".join(rng.choice(string.digits) for _ in range(9))
    return rng.choice([n, f"{n[:3]}-{n[3:7]}-{n[7:]}", f"+86 {n}"])


def us_phone(rng: random.Random) -> str:
    a, b, c = rng.randint(201, 989), rng.randint(200, 999), rng.randint(0, 9999)
    return rng.choice([f"({a}) {b}-{c:04d}", f"{a}-{b}-{c:04d}", f"+1 {a} {b} {c:04d}"])


def api_key(rng: random.Random) -> str:
    alnum = string.ascii_letters + string.digits
    return rng.choice([
        "sk-" + "".join(rng.choice(alnum) for _ in range(40)),
        "sk-proj-" + "".join(rng.choice(alnum) for _ in range(32)),
        "ghp_" + "".join(rng.choice(alnum) for _ in range(36)),
        "AKIA" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(16)),
    ])


def ipv4(rng: random.Random) -> str:
    return ".".join(str(rng.randint(1, 254)) for _ in range(4))


def ipv6(rng: random.Random) -> str:
    return f"2001:db8:{rng.randint(0, 65535):x}::{rng.randint(1, 65535):x}"


def en_name(rng: random.Random) -> str:
    return f"{rng.choice(EN_FIRST)} {rng.choice(EN_LAST)}"


def email(rng: random.Random, name: str | None = None) -> str:
    user = (name or en_name(rng)).lower().replace(" ", rng.choice([".", "_", ""]))
    return f"{user}@{rng.choice(DOMAINS)}"


# Templates: {slot:TYPE} is filled with a generated value of TYPE and labelled.
EN_TEMPLATES = [
    "Hi, I'm {PERSON}. Please call me at {PHONE} or write to {EMAIL}.",
    "Dear {PERSON}, your card {CARD} was charged twice; refund to IBAN {IBAN}.",
    "The staging box at {IP} keeps rejecting the key {KEY}, can you check the nginx config?",
    "Ship the package to {ADDRESS}, attention {PERSON}, phone {PHONE}.",
    "{PERSON} said the VPN endpoint moved to {IP6}; my login is {EMAIL}.",
    "Here is my config: OPENAI_API_KEY={KEY} and the db host {IP}. Why does it time out?",
    "Meeting notes: {PERSON} and {PERSON} agreed to email the contract to {EMAIL} by Friday.",
    "my name is {PERSON_LOWER} and my number is {PHONE}, please help me write a complaint",
    "SIGNED: {PERSON_UPPER}, account holder. Card ending {CARD}.",
    "Write a polite reminder to {PERSON} about the invoice sent to {EMAIL}.",
    "Patient {PERSON}, SSN {SSN}, lives at {ADDRESS}.",
    "Can you format this as JSON: name={PERSON}, email={EMAIL}, ip={IP}",
]
ZH_TEMPLATES = [
    "我叫{ZHNAME}，手机{CNPHONE}，邮箱{EMAIL}，请帮我写一封请假邮件。",
    "请把合同寄到{ZHADDR}，收件人：{ZHNAME}，电话{CNPHONE}。",
    "身份证号{CNID}，姓名{ZHNAME}，请核对信息。",
    "服务器{IP}上的密钥{KEY}泄露了，怎么轮换？",
    "{ZHNAME}的银行卡{CARD}被盗刷了，应该怎么办？",
    "帮我给{ZHNAME}老师写一封感谢信，她的邮箱是{EMAIL}。",
    "客户{ZHNAME}反映，手机号{CNPHONE}收不到验证码。",
    "我住在{ZHADDR}，快递总是送错。",
    "{ZHNAME}和{ZHNAME}明天开会，联系方式{CNPHONE}。",
    "请翻译：我的IP是{IP}，API密钥是{KEY}。",
]
NEGATIVES = [
    "2024-05-01 12:00:03 ERROR worker-3 pid=4512 exited 137; retry 3 of 5 kube-proxy OOMKilled",
    "Order 20240501-7781 shipped on 2024-05-03, 12 items, total 349.90 EUR.",
    "def add(a, b):\n    return a + b  # version 1.2.3, see RFC 7231 section 6.5",
    "The meeting is at 10:30 in room 4B; bring the Q3 report and the ABCDEFGHIJKL code sheet.",
    "Explain binary search in Python with an example list [1, 3, 5, 7, 9].",
    "INFO 09:12:44 GET /api/v1/users/42 200 12ms",
    "Card 4111 1111 1111 1112 is a test number that fails the Luhn check.",
    "Convert 1234567890 seconds to days, hours and minutes.",
    "请解释一下快速排序的时间复杂度，数组长度是100000。",
    "订单号20240501123456已发货，预计3天到达。",
    "版本号1.2.3.4发布于2024年5月1日。",
    "WARNING: disk /dev/sda1 at 91% on node-7, threshold 90%",
]


def fill(template: str, rng: random.Random) -> tuple[str, list[dict]]:
    gens = {
        "PERSON": ("PERSON", lambda: en_name(rng)), "PERSON_LOWER": ("PERSON", lambda: en_name(rng).lower()),
        "PERSON_UPPER": ("PERSON", lambda: en_name(rng).upper()), "PHONE": ("PHONE_NUMBER", lambda: us_phone(rng)),
        "EMAIL": ("EMAIL_ADDRESS", lambda: email(rng)), "CARD": ("CREDIT_CARD", lambda: card(rng)),
        "IBAN": ("IBAN_CODE", lambda: iban(rng)), "IP": ("IP_ADDRESS", lambda: ipv4(rng)),
        "IP6": ("IP_ADDRESS", lambda: ipv6(rng)), "KEY": ("API_KEY", lambda: api_key(rng)),
        "ADDRESS": ("ADDRESS", lambda: f"{rng.randint(1, 999)} {rng.choice(STREETS)}"),
        "SSN": ("US_SSN", lambda: f"{rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"),
        "ZHNAME": ("PERSON", lambda: rng.choice(ZH_NAMES)), "CNPHONE": ("PHONE_NUMBER", lambda: cn_mobile(rng)),
        "CNID": ("CN_RESIDENT_ID", lambda: cn_id(rng)), "ZHADDR": ("ADDRESS", lambda: rng.choice(ZH_ADDR)),
    }
    text, entities, pos = "", [], 0
    while True:
        i = template.find("{", pos)
        if i < 0:
            return text + template[pos:], entities
        j = template.index("}", i)
        kind, make = gens[template[i + 1:j]]
        value = make()
        text += template[pos:i]
        entities.append({"start": len(text), "end": len(text) + len(value), "type": kind, "value": value})
        text += value
        pos = j + 1


def build(seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for lang, templates, copies in (("en", EN_TEMPLATES, 5), ("zh", ZH_TEMPLATES, 5)):
        for _ in range(copies):
            for template in templates:
                text, entities = fill(template, rng)
                rows.append({"lang": lang, "text": text, "entities": entities})
    rows += [{"lang": "zh" if any("\u4e00" <= c <= "\u9fff" for c in t) else "en", "text": t, "entities": []}
             for t in NEGATIVES]
    return rows


def main() -> int:
    rows = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    n = sum(len(r["entities"]) for r in rows)
    print(f"{OUT}: {len(rows)} texts, {n} entities "
          f"(en {sum(len(r['entities']) for r in rows if r['lang'] == 'en')}, "
          f"zh {sum(len(r['entities']) for r in rows if r['lang'] == 'zh')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
