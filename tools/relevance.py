"""BM25 ranking of tools by name and description, offline, for large catalogues."""

from __future__ import annotations

import math
import re
from collections import Counter

_WORD = re.compile(r"[a-z0-9]+")
K1, B = 1.2, 0.75


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("_", " "))


def rank(query: str, documents: dict[str, str]) -> list[str]:
    """Keys of `documents` by descending BM25 score for `query`; ties broken by key."""
    docs = {key: tokens(text) for key, text in documents.items()}
    if not docs:
        return []
    average = sum(len(d) for d in docs.values()) / len(docs) or 1.0
    frequency = Counter(term for d in docs.values() for term in set(d))
    terms = set(tokens(query))
    scores = {}
    for key, words in docs.items():
        counts = Counter(words)
        score = 0.0
        for term in terms & counts.keys():
            idf = math.log(1 + (len(docs) - frequency[term] + 0.5) / (frequency[term] + 0.5))
            tf = counts[term]
            score += idf * tf * (K1 + 1) / (tf + K1 * (1 - B + B * len(words) / average))
        scores[key] = score
    return sorted(scores, key=lambda k: (-scores[k], k))
