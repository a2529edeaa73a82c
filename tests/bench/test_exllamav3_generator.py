"""bench/exllamav3_generator.py sizes exllamav3's cache so that every job of its largest level is active at once,
by exllamav3 1.6.5's own page arithmetic, read from its sources (ci/exllamav3-source.sh): ``Sequence.prepare``
(generator/pagetable.py) run as written, and the job's token budget (generator/job.py), so that a change of either
in a later exllamav3 fails here rather than on the GPU. Run 25's cache (``top x (prompt + output) + 256`` tokens)
held 24 of 32 jobs of 512 + 256 tokens; the level was a queue."""

from __future__ import annotations

import ast
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import exllamav3_generator as gen  # noqa: E402

SOURCES = sorted((ROOT / ".cache" / "exllamav3").glob("*/exllamav3"))
pytestmark = pytest.mark.skipif(not SOURCES, reason="exllamav3 sources not fetched (bash ci/exllamav3-source.sh)")


def exllamav3_pages(prompt: int, output: int) -> int:
    """The pages exllamav3's own Sequence.prepare reserves for a fresh job (its source compiled and called on a
    stand-in sequence: fake input, the arithmetic is exllamav3's)."""
    exl = SOURCES[-1]
    page_size = next(
        n.value.value
        for n in ast.parse((exl / "constants.py").read_text()).body
        if isinstance(n, ast.Assign) and n.targets[0].id == "PAGE_SIZE"
    )
    tree = ast.parse((exl / "generator" / "pagetable.py").read_text())
    prepare = next(
        f
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "prepare"
    )
    job = (exl / "generator" / "job.py").read_text()
    assert "self.max_rq_tokens = self.max_new_tokens + 1 + self.generator.max_draft_tokens" in job
    namespace = {"PAGE_SIZE": page_size, "tensor_hash_checksum": lambda ids, prev: hash((tuple(ids), prev))}
    exec(compile(ast.Module([prepare], []), "pagetable.py", "exec"), namespace)

    class Page(tuple):
        @property
        def shape(self):
            return (len(self),)

    class Ids(list):
        def torch_slice(self, a, b):
            return Page(self[a:b])

    class Seq:
        sequence_ids = Ids(range(prompt))

    seq = Seq()
    hashes, new = namespace["prepare"](seq, False, output + 1)  # max_rq_tokens with no draft
    return len(hashes) + new


@pytest.mark.parametrize("prompt, output", [(512, 256), (128, 64), (255, 0), (256, 255), (1000, 1)])
def test_a_jobs_pages_are_exllamav3s(prompt, output):
    assert gen.pages_per_job(prompt, output) == exllamav3_pages(prompt, output)


@pytest.mark.parametrize("top", [1, 8, 32, 64])
def test_the_cache_holds_every_job_of_the_largest_level_at_once(top):
    for prompt, output in ((512, 256), (128, 64)):
        tokens = gen.cache_tokens(top, prompt, output)
        assert tokens % gen.PAGE_SIZE == 0
        assert tokens // gen.PAGE_SIZE >= top * exllamav3_pages(prompt, output)


def test_run_25s_cache_held_jobs_back():
    old_pages = (32 * (512 + 256) + 256) // gen.PAGE_SIZE
    assert old_pages == 97 and old_pages // exllamav3_pages(512, 256) == 24  # 24 of 32 jobs active


def test_the_state_dtype_is_exllamav3s_choice_of_two(capsys):
    assert gen.parser().parse_args(["m", "--serve"]).state_dtype == "float16"  # exllamav3's Cache default
    assert gen.parser().parse_args(["m", "--serve", "--state-dtype", "float32"]).state_dtype == "float32"
    with pytest.raises(SystemExit):
        gen.parser().parse_args(["m", "--serve", "--state-dtype", "bfloat16"])  # exllamav3 refuses bf16 state
    assert "invalid choice" in capsys.readouterr().err
    cache = (SOURCES[-1] / "cache" / "cache.py").read_text()
    assert "recurrent_dtype: torch.dtype = torch.half" in cache
