"""bench/same_run.py on the CPU: two aphrodite variants (stand-in servers, fake input: the client, the alternation,
the prompts and the summary are the real code), one started from another PATH as another release's is, and an
exllamav3 variant through bench/exl3_worker.py and exllamav3_generator.serve() with a stand-in generator."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
import threading

import pytest

from helpers import ROOT, free_port, install_fake_aphrodite

sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
import exl3_worker  # noqa: E402
import same_run  # noqa: E402
from test_serving_http import STREAMING_APHRODITE  # noqa: E402

FAKE_GENERATOR_SCRIPT = textwrap.dedent("""\
    # stand-in for bench/exllamav3_generator.py --serve (fake input: the generator); serve() is the real one
    import json, sys
    sys.path[:0] = [{bench!r}, {unit!r}, {tests!r}]
    import exllamav3_generator as real
    from test_serving_http import _Generator, _Job

    class Torch:
        tensor = staticmethod(lambda x: x)

    args = sys.argv[1:]
    prompt, output = (int(args[args.index(k) + 1]) for k in ("--prompt", "--output"))
    print("READY " + json.dumps({{"load_s": 1.5, "warmup_s": 2.5, "warmup": {{"completed": 1}}}}), flush=True)
    mtp = int(args[args.index("--mtp") + 1]) if "--mtp" in args else 0
    real.serve(_Generator(output, max_draft_tokens=mtp), _Job, None, 5000, prompt, Torch)
""")


@pytest.fixture
def engines(tmp_path, monkeypatch):
    pytest.importorskip("openai")
    install_fake_aphrodite(tmp_path, monkeypatch, STREAMING_APHRODITE)
    other = tmp_path / "other-release" / "bin"  # a second console script, as a staged release's bin/ holds it
    other.mkdir(parents=True)
    script = STREAMING_APHRODITE.replace("{python}", sys.executable).replace("4,321 tokens", "1,234 tokens")
    (other / "aphrodite").write_text(script)
    (other / "aphrodite").chmod(0o755 | stat.S_IEXEC)
    fake_bench = tmp_path / "fake-bench"
    fake_bench.mkdir()
    script = FAKE_GENERATOR_SCRIPT.format(
        bench=str(ROOT / "bench"), unit=str(ROOT / "tests" / "bench"), tests=str(ROOT / "tests")
    )
    (fake_bench / "exllamav3_generator.py").write_text(script)
    monkeypatch.setattr(exl3_worker, "BENCH", fake_bench)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 5000}}))
    return model, other, tmp_path


def test_aphrodite_variants_and_exllamav3_alternate_on_the_same_prompts(engines):
    model, other, tmp = engines
    out = tmp / "run.json"
    argv = [
        str(model),
        "--out",
        str(out),
        "--variant",
        f"a=--enable-lora --lora-modules bench={tmp}",
        "--variant",
        "b=",
    ]
    argv += ["--exllamav3", "exl3"]
    argv += ["--variant-env", f"b=PATH={other}:/usr/bin:/bin", "--variant-env", "exl3=HXF_MARK=1"]
    argv += ["--concurrency", "1,3", "--repeats", "2", "--prompt", "8", "--output", "12", "--port", str(free_port())]
    argv += ["--start-timeout", "60", "--levels", "exl3=3"]
    assert same_run.main(argv) == 0
    run = json.loads(out.read_text())
    v = run["variants"]
    assert all(v[n]["started"] for n in ("a", "b", "exl3"))
    assert v["a"]["kv_cache_tokens"] == 4321 and v["b"]["kv_cache_tokens"] == 1234  # b ran the other release's
    # a's requests name its adapter
    assert same_run.request_model("a", ["--enable-lora", "--lora-modules", "bench=/x"]) == "bench"
    assert same_run.request_model("b", ["--lora-modules"]) == "b"
    assert v["b"]["command"][0] == str(other / "aphrodite") and "--lora-modules" in v["a"]["command"]
    assert v["exl3"]["load_s"] == 1.5 and v["exl3"]["warmup"] == {"completed": 1}
    order = [(r["repeat"], r["concurrency"], r["variant"]) for r in run["runs"]]
    assert order == [
        *((0, n, x) for n in (1, 3) for x in ("a", "b", "exl3") if (x, n) != ("exl3", 1)),
        *((1, n, x) for n in (1, 3) for x in ("exl3", "b", "a") if (x, n) != ("exl3", 1)),
    ]  # exl3 runs only its own level
    for r in run["runs"]:
        assert r["completed"] == r["concurrency"] and r["decode_tok_s"] > 0 and r["per_request_tok_s"] > 0
    assert set(run["summary"]) == {"a", "b", "exl3"} and run["summary"]["exl3"]["3"]["decode_tok_s"]["median"] > 0
    assert set(run["summary"]["exl3"]) == {"3"} and run["variant_levels"]["exl3"] == [3]
    assert (run["prompt"], run["output"]) == (8, 12)
    assert "level_seed" in run["prompts"]


def test_a_worker_that_dies_gives_failed_levels_and_the_run_goes_on(engines, tmp_path):
    model, _, tmp = engines
    (exl3_worker.BENCH / "exllamav3_generator.py").write_text("import sys; print('READY {}', flush=True); sys.exit(3)")
    out = tmp / "run.json"
    argv = [str(model), "--out", str(out), "--variant", "a=", "--exllamav3", "exl3", "--concurrency", "2"]
    argv += ["--repeats", "1", "--prompt", "8", "--output", "6", "--port", str(free_port()), "--start-timeout", "60"]
    assert same_run.main(argv) == 0
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["a"]["completed"] == 2
    assert runs["exl3"]["completed"] == 0 and runs["exl3"]["failed"] == 2 and runs["exl3"]["first_failure"]


def test_a_held_variant_starts_when_its_file_appears_and_is_left_out_with_the_files_reason(engines):
    model, _, tmp = engines
    flag = tmp / "ext-ready"
    threading.Timer(1.5, flag.write_text, args=("",)).start()  # the extension arrives while the engine starts
    argv = [str(model), "--variant", "a=", "--exllamav3", "exl3", "--start-after", f"exl3={flag}"]
    argv += ["--concurrency", "2", "--repeats", "1", "--prompt", "8", "--output", "6", "--start-timeout", "60"]
    assert same_run.main([*argv, "--out", str(tmp / "one.json"), "--port", str(free_port())]) == 0
    run = json.loads((tmp / "one.json").read_text())
    assert run["variants"]["exl3"]["started"] and run["variants"]["exl3"]["held_s"] >= 1.0
    assert {r["variant"]: r["completed"] for r in run["runs"]} == {"a": 2, "exl3": 2}

    flag.write_text("no exllamav3 extension after 900 s\n")  # the build failed: the others are measured alone
    assert same_run.main([*argv, "--out", str(tmp / "two.json"), "--port", str(free_port())]) == 0
    run = json.loads((tmp / "two.json").read_text())
    v = run["variants"]["exl3"]
    assert not v["started"] and v["error"] == "not started: no exllamav3 extension after 900 s"
    assert [r["variant"] for r in run["runs"]] == ["a"] and "exl3" in run["summary"]


def test_a_variant_ready_after_the_first_is_waited_for_until_the_common_start_deadline(engines):
    """Every variant's start has the deadline t0 + --start-timeout. A variant still compiling when the one before
    it became ready was judged "did not start" within a poll once more than half that timeout had gone (its wait
    was given the time left from now, counted from its own start), and left out of the measured levels although
    it was ready seconds later."""
    model, _, tmp = engines
    out = tmp / "slow.json"
    argv = [str(model), "--out", str(out), "--variant", "a=", "--variant", "b="]
    # b starts later than the timeout less a's start (the old wait gave it 24 - 10 s), with 8 s and more to spare
    # for each on a loaded machine (make test runs the lanes side by side)
    argv += ["--variant-env", "a=FAKE_START_S=10", "--variant-env", "b=FAKE_START_S=16"]
    argv += ["--concurrency", "1", "--repeats", "1", "--prompt", "8", "--output", "6", "--port", str(free_port())]
    assert same_run.main([*argv, "--start-timeout", "24"]) == 0
    v = json.loads(out.read_text())["variants"]
    assert v["a"]["started"] and v["b"]["started"], v
    assert v["b"]["ready_s"] >= 16 and [r["variant"] for r in json.loads(out.read_text())["runs"]] == ["a", "b"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--variant-env", "nobody=X=1"], "--variant-env names no variant"),
        (["--variant-env", "a"], "--variant-env takes"),
        (["--exllamav3", "a"], "variant names repeat"),
        (["--concurrency", "1,x"], "--concurrency takes"),
        (["--start-after", "nobody=/tmp/x"], "--start-after names no variant"),
        (["--start-after", "a"], "--start-after takes"),
        (["--levels", "nobody=1"], "--levels names no variant"),
        (["--levels", "a=1,x"], "--levels takes"),
        (["--levels", "a=7"], "not in --concurrency"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(engines, capsys, extra, message):
    model, _, tmp = engines
    with pytest.raises(SystemExit) as e:
        same_run.main([str(model), "--out", str(tmp / "r.json"), "--variant", "a=", *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err and not (tmp / "r.json").exists()


def run_one(engines, extra: list[str], name: str = "run.json", levels: str = "1,3", repeats: int = 1) -> dict:
    model, _, tmp = engines
    out = tmp / name
    argv = [str(model), "--out", str(out), "--concurrency", levels, "--repeats", str(repeats)]
    argv += ["--prompt", "8", "--output", "12", "--port", str(free_port()), "--start-timeout", "60", *extra]
    assert same_run.main(argv) == 0
    return json.loads(out.read_text())


def test_every_measured_shape_is_warmed_first_with_prompts_no_level_repeats(engines):
    from level_figures import level_seed, warmup_seed

    run = run_one(engines, ["--variant", "a=", "--exllamav3", "exl3"])
    for name in ("a", "exl3"):
        warm = run["variants"][name]["warmup_levels"]
        assert [w["concurrency"] for w in warm] == [1, 3] and all(w["completed"] == w["concurrency"] for w in warm)
    assert not {warmup_seed(n) for n in (1, 3, 64)} & {level_seed(n, r) for n in (1, 3, 64) for r in range(10)}
    assert all(r["refused"] == [] for r in run["runs"]), run["runs"]  # the stand-ins serve every level soundly
    assert all(r["active"] == r["concurrency"] for r in run["runs"])


def test_the_variants_not_being_measured_are_stopped_meanwhile(engines):
    """a logs a heartbeat every 10 ms while its process runs; none may fall inside b's levels."""
    run = run_one(engines, ["--variant", "a=", "--variant", "b=", "--variant-env", "a=FAKE_TICK=1"], repeats=2)
    _, _, tmp = engines
    ticks = [float(line.split()[1]) for line in (tmp / "run-a.log").read_text().splitlines() if line.startswith("TICK")]
    b_rows = [r for r in run["runs"] if r["variant"] == "b"]
    assert b_rows and all(r["paused"] == ["a"] for r in b_rows) and run["pause_idle"] is True
    for r in b_rows:
        assert not [t for t in ticks if r["t_start"] < t < r["t_end"]], f"a ran during b's level {r}"
    a_rows = [r for r in run["runs"] if r["variant"] == "a"]
    assert all(any(r["t_start"] < t < r["t_end"] for t in ticks) for r in a_rows)  # and it runs in its own
    assert ticks[-1] > max(r["t_end"] for r in run["runs"])  # resumed at the end: it stopped on SIGINT, not SIGKILL


def test_without_pausing_the_other_variants_run_on(engines):
    run = run_one(engines, ["--variant", "a=", "--variant", "b=", "--variant-env", "a=FAKE_TICK=1", "--no-pause"])
    _, _, tmp = engines
    ticks = [float(line.split()[1]) for line in (tmp / "run-a.log").read_text().splitlines() if line.startswith("TICK")]
    b = next(r for r in run["runs"] if r["variant"] == "b" and r["concurrency"] == 3)
    assert b["paused"] == [] and any(b["t_start"] < t < b["t_end"] for t in ticks) and run["pause_idle"] is False


@pytest.mark.parametrize(
    "env, reason",
    [
        ("FAKE_SERIAL=1", "at most 1 of 3 requests streamed at once"),
        ("FAKE_CHUNK=2", "streamed 6-6 chunks a request, not one a token (12)"),
    ],
    ids=["queued", "chunked"],
)
def test_a_level_not_served_as_one_batch_token_by_token_is_refused_and_left_out(engines, env, reason):
    run = run_one(engines, ["--variant", "a=", "--variant-env", f"a={env}"])
    by_n = {r["concurrency"]: r for r in run["runs"]}
    assert reason in by_n[3]["refused"]
    assert "per_request_tok_s" not in run["summary"]["a"]["3"] and run["summary"]["a"]["3"]["refused"]["rows"] == 1
    if env == "FAKE_SERIAL=1":  # one request at a time is still a batch of one
        assert by_n[1]["refused"] == [] and run["summary"]["a"]["1"]["per_request_tok_s"]["median"] > 0


def test_exllamav3_jobs_held_back_refuse_the_level(engines):
    """The worker's generator runs 2 jobs at a time (a cache too small for 3, as run 25's at N = 32)."""
    model, _, tmp = engines
    script = (exl3_worker.BENCH / "exllamav3_generator.py").read_text()
    (exl3_worker.BENCH / "exllamav3_generator.py").write_text(
        script.replace("_Generator(output, ", "_Generator(output, 2, ")
    )
    run = run_one(engines, ["--exllamav3", "exl3"])
    three = next(r for r in run["runs"] if r["concurrency"] == 3)
    assert three["active_jobs"] == 2 and "at most 2 of 3 jobs active in the generator" in three["refused"]
    assert "at most 2 of 3 requests streamed at once" in three["refused"]
    assert next(r for r in run["runs"] if r["concurrency"] == 1)["refused"] == []


def test_a_compile_or_a_preemption_inside_a_level_refuses_it(engines):
    """The K-th completion request (1 warm-up, 1 + 3 warm-up levels, then 1 at N = 1, 3 at N = 3) compiles: the
    9th is the last of the measured N = 3 level. A token takes 0.15 s, so that each level has whole seconds of its
    own (the JIT warning's stamp has whole seconds)."""
    _, _, tmp = engines
    cache = tmp / "triton-cache"
    cache.mkdir()
    env = f"a=FAKE_COMPILE_AT=9 FAKE_COMPILE_DIR={cache} FAKE_TOKEN_S=0.15"
    run = run_one(engines, ["--variant", "a=", "--variant-env", env, "--watch-dir", str(cache)])
    three = next(r for r in run["runs"] if r["concurrency"] == 3)
    assert f"compiled inside: {cache / 'kernel-9.cubin'}" in three["refused"]
    assert "compiled inside: Triton JIT of _k" in three["refused"]
    assert next(r for r in run["runs"] if r["concurrency"] == 1)["refused"] == []
    assert {c["level"] for c in run["compiles"]} == {"a N=3 repeat 0"}
    assert run["compile_check"]["watched"] == [str(cache)]

    run = run_one(engines, ["--variant", "a=", "--variant-env", "a=FAKE_PREEMPT_AT=6"], name="pre.json")
    one, three = (next(r for r in run["runs"] if r["concurrency"] == n) for n in (1, 3))
    assert one["preemptions"] == 1 and "1 preemptions" in one["refused"]
    assert three["preemptions"] == 0 and three["refused"] == []


def test_each_variant_records_the_state_dtype_it_serves_and_the_runs_bandwidth(engines):
    model, _, tmp = engines
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 5000, "mamba_ssm_dtype": "float32"}}))
    bandwidth = tmp / "bw.json"
    bandwidth.write_text(json.dumps({"copy_bandwidth_gbps": 3012.5}))
    extra = ["--variant", "fp32=", "--variant", "bf16=--mamba-ssm-cache-dtype bfloat16"]
    extra += ["--exllamav3", "x3", "--exllamav3", "x3-fp32=--state-dtype float32", "--bandwidth-file", str(bandwidth)]
    run = run_one(engines, extra, levels="1")
    assert {n: v["state_dtype"] for n, v in run["variants"].items()} == {
        "fp32": "float32",
        "bf16": "bfloat16",
        "x3": "float16",
        "x3-fp32": "float32",
    }
    assert run["variants"]["x3-fp32"]["command"][-2:] == ["--state-dtype", "float32"]
    assert run["bandwidth"] == {"copy_bandwidth_gbps": 3012.5}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exllamav3", "=x"], "--exllamav3 takes"),
        (["--bandwidth-file", "/nonexistent/bw.json"], "--bandwidth-file /nonexistent/bw.json: not roofline.py"),
    ],
)
def test_bad_sound_arguments_are_refused_in_one_line(engines, capsys, extra, message):
    model, _, tmp = engines
    with pytest.raises(SystemExit) as e:
        same_run.main([str(model), "--out", str(tmp / "r.json"), "--variant", "a=", *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err and not (tmp / "r.json").exists()


def test_mtp_variants_pools_and_exllamav3_drafts_through_one_process(engines):
    """An aphrodite variant with --speculative-config (two tokens a chunk) is checked by its usage count and keeps the
    engine's speculative counters per level; exllamav3 started with --mtp 2 is measured without drafting and, as
    ALIAS, drafting 2 tokens a step in the same process (never stopped while its alias runs); every level once per
    pool, its prompts from that pool."""
    model, _, tmp = engines
    out = tmp / "run.json"
    spec = """'{"method": "mtp", "num_speculative_tokens": 2}'"""
    argv = [str(model), "--out", str(out), "--variant", "base=", "--variant", f"mtp2=--speculative-config {spec}"]
    argv += ["--variant-env", "mtp2=FAKE_CHUNK=2", "--exllamav3", "x3=--mtp 2", "--exllamav3-draft", "x3-mtp2=x3:2"]
    argv += ["--pool", "lo=0:250", "--pool", "hi=250:500", "--concurrency", "1,2", "--repeats", "2"]
    argv += ["--prompt", "8", "--output", "12", "--port", str(free_port()), "--start-timeout", "60"]
    assert same_run.main(argv) == 0
    run = json.loads(out.read_text())
    v = run["variants"]
    assert all(v[n]["started"] for n in v) and v["x3-mtp2"]["draft_tokens"] == 2 and v["x3-mtp2"]["process_of"] == "x3"
    assert (v["mtp2"]["speculative"], v["base"]["speculative"], v["x3-mtp2"]["speculative"]) == (True, False, True)
    assert run["pools"] == {"lo": [0, 250], "hi": [250, 500]}
    assert len(run["runs"]) == 2 * 2 * 2 * 4 and {r["pool"] for r in run["runs"]} == {"lo", "hi"}
    assert not any(r["refused"] for r in run["runs"]), [r["refused"] for r in run["runs"] if r["refused"]]
    for r in run["runs"]:
        if r["variant"] == "mtp2":
            assert r["chunks_max"] == 6 and r["tokens_min"] == 12  # two tokens a chunk, usage counts all 12
            assert r["spec"]["draft_acceptance"] == 0.5 and r["spec"]["per_position"] == [1.0, 0.0]
            assert r["spec"]["drafts"] == 6 * r["concurrency"]
        if r["variant"] == "x3-mtp2":
            assert r["draft_tokens"] == 2 and r["draft_acceptance"] == round(2 / 3, 4)
            assert "x3" not in r["paused"]  # its own process runs it
        if r["variant"] == "x3":
            assert "draft_acceptance" not in r
        if r["variant"] == "base":
            assert "spec" not in r and r["chunks_max"] == 12
    assert set(run["summary"]["mtp2"]) == {"lo/1", "lo/2", "hi/1", "hi/2"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--exllamav3-draft", "d=nobody:2"], "is no --exllamav3 variant"),
        (["--exllamav3-draft", "d=x3:0"], "ALIAS=NAME:K"),
        (["--exllamav3-draft", "d=x3:2", "--exllamav3", "x3"], "was not started with --mtp"),
        (["--pool", "p=5:3"], "NAME=LO:HI"),
        (["--pool", "p=0:3", "--pool", "p=3:9"], "--pool names repeat"),
    ],
)
def test_bad_draft_and_pool_arguments_are_refused_in_one_line(engines, capsys, extra, message):
    model, _, tmp = engines
    with pytest.raises(SystemExit) as e:
        same_run.main([str(model), "--out", str(tmp / "r.json"), "--variant", "a=", *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
