"""Retrieval for search-agent trajectories without a server: an in-process BM25 index over a
corpus given in the config, so tests and CPU runs need no Elasticsearch or embedding model."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from agent.tools.base import BaseTool, ToolResponse

_TOKEN = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens; enough for BM25 over English passages."""
    return _TOKEN.findall(text.lower())


class BM25:
    """Okapi BM25: score(d, q) = sum_t idf(t) * tf*(k1+1) / (tf + k1*(1 - b + b*|d|/avgdl)),
    with idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) (never negative). Postings are kept per
    term so a query only touches documents that contain one of its terms."""

    def __init__(self, docs: list[str], k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.doc_len: list[int] = []
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for i, doc in enumerate(docs):
            counts = Counter(tokenize(doc))
            self.doc_len.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings.setdefault(term, []).append((i, tf))
        n = len(docs)
        self.avgdl = (sum(self.doc_len) / n) if n else 0.0
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        """Document index -> score, for documents sharing at least one term with the query."""
        out: dict[int, float] = {}
        for term in tokenize(query):  # a repeated query term counts again, as in the classic formula
            for i, tf in self.postings.get(term, ()):
                norm = self.k1 * (1 - self.b + self.b * self.doc_len[i] / (self.avgdl or 1.0))
                out[i] = out.get(i, 0.0) + self.idf[term] * tf * (self.k1 + 1) / (tf + norm)
        return out

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best (index, score), best first; ties broken by corpus order for determinism."""
        return sorted(self.scores(query).items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def load_corpus(config: dict[str, Any]) -> list[dict[str, str]]:
    """Passages from `corpus_path` (jsonl of {"id","text"}) or `corpus` (list of dicts or strings)."""
    if "corpus_path" in config:
        path = Path(config["corpus_path"])
        if not path.exists():
            raise ValueError(f"search corpus_path {str(path)!r} does not exist; point it at a jsonl of "
                             '{"id": ..., "text": ...} lines')
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one object") from None
    elif "corpus" in config:
        rows = list(config["corpus"])
    else:
        raise ValueError("SearchTool config needs `corpus_path: file.jsonl` or `corpus: [{id, text}, ...]`")
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            row = {"id": str(i), "text": row}
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"search corpus entry {i} is {row!r}; expected {{'id': ..., 'text': '...'}}")
        out.append({"id": str(row.get("id", i)), "text": row["text"]})
    return out


class SearchTool(BaseTool):
    """`{"query": "...", "top_k": 3}` -> the best passages, numbered, as one text.
    Config: corpus_path | corpus, k1, b, default_top_k, max_top_k, max_passage_chars."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self.passages = load_corpus(self.config)
        self.index = BM25([p["text"] for p in self.passages], float(self.config.get("k1", 1.2)),
                          float(self.config.get("b", 0.75)))

    def search(self, query: str, top_k: int) -> list[dict[str, Any]]:
        """The top passages with their scores (what execute renders)."""
        return [dict(self.passages[i], score=s) for i, s in self.index.top(query, top_k)]

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResponse(f"Error: `query` must be a non-empty string, got {query!r}", success=False)
        try:
            top_k = int(arguments.get("top_k") or self.config.get("default_top_k", 3))
        except (TypeError, ValueError):
            return ToolResponse(f"Error: `top_k` must be an integer, got {arguments.get('top_k')!r}", success=False)
        top_k = max(1, min(top_k, int(self.config.get("max_top_k", 10))))
        hits = self.search(query, top_k)
        if not hits:
            return ToolResponse(f"No passages match {query!r}.", metrics={"hits": 0})
        cap = int(self.config.get("max_passage_chars", 1000))
        text = "\n".join(f"[{n}] (id={h['id']}) {h['text'][:cap]}" for n, h in enumerate(hits, 1))
        return ToolResponse(text, metrics={"hits": len(hits)})
