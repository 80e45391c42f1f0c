"""SuffixDecoding (Oliaro et al., NeurIPS 2025), the strongest model-free drafter, as a peer in
this library's own draft -> verify loop: a benchmark peer, never a dependency of the library.

    python -m benchmarks.suffix_decoding --build    # once: builds the peer into the cache folder

The peer is arctic-inference's suffix tree (`csrc/suffix_decoding`: C++ with nanobind bindings)
and its `SuffixDecodingCache` (prompt trees per request, one global tree of earlier responses).
`--build` fetches arctic-inference's source distribution from the package index, compiles only
that extension (cmake, ninja and nanobind from the index; no vLLM, no CUDA) and keeps it under
`cache_dir()/suffix_decoding/`. `SuffixDrafter` adapts the cache to the `Drafter` interface: its
drafts are trees (tokens + parents) or paths, verified exactly like NASD's; `load_peer()` says why
the peer is unavailable when it was not built.
"""

from __future__ import annotations

import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

from torch import Tensor

from benchmarks import cli
from sampling import DraftTree, speculative_generate
from sampling.loop.drafts import PerRow
from utils.loading import cache_dir
from utils.logits_processors import GreedyProcessor

VERSION = "0.3.0"
SIMPLE_INDEX = "https://pypi.org/simple/arctic-inference/"
# vLLM's defaults for its `suffix` speculation method.
MAX_TREE_DEPTH, MAX_SPEC_FACTOR, MIN_TOKEN_PROB, MAX_SPEC_TOKENS = 24, 1.0, 0.1, 8


def peer_dir() -> Path:
    return cache_dir() / "suffix_decoding" / VERSION


def build() -> Path:
    """Fetch arctic-inference's source, compile its suffix tree, keep it in `peer_dir()`."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "nanobind", "cmake", "ninja"], check=True)
    html = urllib.request.urlopen(SIMPLE_INDEX, timeout=120).read().decode()
    link = re.search(rf'href="([^"]*arctic_inference-{re.escape(VERSION)}\.tar\.gz[^"]*)"', html)
    if link is None:
        raise RuntimeError(f"arctic-inference {VERSION}'s source distribution is not on {SIMPLE_INDEX}")
    url = link.group(1).replace("&amp;", "&")
    source = tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(url, timeout=300).read()))
    target = peer_dir()
    with tempfile.TemporaryDirectory() as work:
        source.extractall(work, filter="data")
        root = Path(work) / f"arctic_inference-{VERSION}"
        build_dir = Path(work) / "build"
        cmake = [sys.executable, "-m", "cmake"] if shutil.which("cmake") is None else ["cmake"]
        subprocess.run([*cmake, "-S", str(root / "csrc" / "suffix_decoding"), "-B", str(build_dir), "-G", "Ninja",
                        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"], check=True)
        subprocess.run([*cmake, "--build", str(build_dir)], check=True)
        package = target / "arctic_inference" / "suffix_decoding"
        package.mkdir(parents=True, exist_ok=True)
        (target / "arctic_inference" / "__init__.py").write_text("")
        for name in ("__init__.py", "cache.py"):
            shutil.copy(root / "arctic_inference" / "suffix_decoding" / name, package / name)
        shutil.copy(root / "LICENSE", target / "LICENSE")
        for library in build_dir.glob("_C*"):
            if library.suffix in (".so", ".pyd"):
                shutil.copy(library, package / library.name)
    return target


def load_peer() -> tuple[type | None, str]:
    """(arctic-inference's `SuffixDecodingCache`, "") once built; else (None, why not)."""
    folder = peer_dir()
    if not (folder / "arctic_inference" / "suffix_decoding" / "cache.py").exists():
        return None, f"SuffixDecoding is not built here: run `python -m benchmarks.suffix_decoding --build` (into {folder})"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("arctic_inference.suffix_decoding")
    except ImportError as error:  # built for another Python, or a missing library
        return None, f"SuffixDecoding in {folder} does not load: {error}; rebuild with --build"
    return module.SuffixDecodingCache, ""


@dataclass
class PythonSuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class PythonSuffixCache:
    """A small pure-Python stand-in with `SuffixDecodingCache`'s interface (for tests, and where the
    peer is not built): the longest suffix of the context (up to `max_tree_depth`) found in the
    request's prompt and response or in earlier responses; a path of the most frequent
    continuations, each token's probability its share of the counts, stopping below
    `min_token_prob`, at most `max_spec_factor * match length` tokens. Slow; no trees."""

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1) -> None:
        self.max_tree_depth = max_tree_depth
        self._active: dict[Hashable, list[int]] = {}
        self._responses: dict[Hashable, list[int]] = {}

    @property
    def active_requests(self):
        return self._active.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self._active:
            raise ValueError(f"Request '{req_id}' is already active")
        self._active[req_id] = list(prompt_token_ids)
        self._responses[req_id] = []

    def stop_request(self, req_id: Hashable) -> None:
        if req_id not in self._active:
            raise ValueError(f"Request '{req_id}' is not active")
        del self._active[req_id]

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        if req_id not in self._active:
            raise ValueError(f"Request '{req_id}' is not active")
        self._active[req_id] += list(token_ids)
        self._responses[req_id] += list(token_ids)

    def _next_tokens(self, texts: list[list[int]], suffix: list[int]) -> Counter:
        found: Counter = Counter()
        for text in texts:
            for end in range(len(suffix), len(text)):
                if text[end - len(suffix) : end] == suffix:
                    found[text[end]] += 1
        return found

    def speculate(self, req_id: Hashable, context: Sequence[int], max_spec_tokens: int | None = None,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  use_tree_spec: bool = False) -> PythonSuffixDraft:
        texts = [self._active[req_id]] + [r for key, r in self._responses.items() if key != req_id]
        context = list(context)[-self.max_tree_depth :]
        draft = PythonSuffixDraft()
        for length in range(min(len(context), self.max_tree_depth), 0, -1):
            if self._next_tokens(texts, context[-length:]):
                draft.match_len = length
                break
        limit = min(max_spec_tokens or self.max_tree_depth, int(max_spec_factor * draft.match_len + max_spec_offset))
        suffix, probability = context[len(context) - draft.match_len :], 1.0
        while draft.match_len and len(draft.token_ids) < limit:
            found = self._next_tokens(texts, suffix)
            if not found:
                break
            token, hits = found.most_common(1)[0]
            probability *= hits / sum(found.values())
            if probability < min_token_prob:
                break
            draft.parents.append(len(draft.token_ids) - 1)
            draft.token_ids.append(token)
            draft.probs.append(probability)
            draft.score += probability
            suffix = (suffix + [token])[-self.max_tree_depth :]
        return draft


class SuffixDrafter:
    """One row's drafter over a `SuffixDecodingCache` (the peer's, or the stand-in): the prompt is
    the request's local tree, every accepted token extends its response, and the responses of
    earlier generations stay in the cache's global tree (the cache is shared across calls)."""

    forward_passes = 0
    _ids = count()

    def __init__(self, cache, *, use_tree_spec: bool = False, max_spec_tokens: int = MAX_SPEC_TOKENS,
                 max_spec_factor: float = MAX_SPEC_FACTOR, min_token_prob: float = MIN_TOKEN_PROB) -> None:
        self.cache = cache
        self.settings = dict(max_spec_factor=max_spec_factor, min_token_prob=min_token_prob, use_tree_spec=use_tree_spec)
        self.max_spec_tokens = max_spec_tokens
        self.request: int | None = None
        self._taught = 0  # tokens of the sequence the cache holds for the request

    def start(self, sequence: list[int]) -> None:
        if self.request is not None and self.request in self.cache.active_requests:
            self.cache.stop_request(self.request)  # the previous response stays in the global tree
        self.request = next(self._ids)
        self.cache.start_request(self.request, list(sequence))
        self._taught = len(sequence)

    def draft(self, sequence: list[int], max_drafts: int, max_depth: int | None = None) -> tuple[DraftTree, None]:
        max_depth = max_drafts if max_depth is None else max_depth
        limit = min(max_drafts, self.max_spec_tokens)
        if limit <= 0 or max_depth <= 0:
            return DraftTree.chain([]), None
        found = self.cache.speculate(self.request, list(sequence[-self.cache.max_tree_depth :]),
                                     max_spec_tokens=limit, **self.settings)
        depths: list[int] = []
        for parent in found.parents:
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        keep = [i for i, depth in enumerate(depths) if depth <= max_depth]  # parents before children: still a tree
        index = {old: new for new, old in enumerate(keep)}
        tokens = [int(found.token_ids[i]) for i in keep]
        parents = [index[found.parents[i]] if found.parents[i] >= 0 else -1 for i in keep]
        return DraftTree(tokens, parents), None

    def update(self, sequence: list[int], path: list[int], target_logits: Tensor, p: Tensor | None) -> None:
        self.cache.add_active_response(self.request, list(sequence[self._taught :]))
        self._taught = len(sequence)


def cache_with_responses(peer, responses: Sequence[Sequence[int]]):
    """A fresh `peer` cache (vLLM's tree depth) whose global tree holds `responses`, the outputs
    of earlier generations: a benchmark that runs a prompt several times gives each run the
    responses to the other prompts only (its own earlier response would be copied whole)."""
    cache = peer(max_tree_depth=MAX_TREE_DEPTH)
    for index, response in enumerate(responses):
        key = ("earlier response", index)
        cache.start_request(key, [])
        cache.add_active_response(key, list(response))
        cache.stop_request(key)
    return cache


def run_suffix(ids, model, cache, *, max_new_tokens, end_tokens, stats, on_step, processor=GreedyProcessor(),
               generator=None):
    """SuffixDecoding's drafts through the same loop as NASD's, by the public door for your own
    drafter (docs/drafters.md: `PerRow` makes the one-row drafter a batch one) -> (ids, alpha)."""
    return speculative_generate(ids, PerRow([SuffixDrafter(cache)]), model, gamma=8, logits_processor=processor,
                                max_gen_len=max_new_tokens, end_tokens_id=end_tokens, generator=generator,
                                stats=stats, on_step=on_step)


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    parser.add_argument("--build", action="store_true", help="build the peer into the cache folder")
    args = cli.parse(parser, argv)
    if args.build:
        print(f"built into {build()}")
    peer, why = load_peer()
    print("SuffixDecoding peer: " + ("ready" if peer else why))


if __name__ == "__main__":
    main()
