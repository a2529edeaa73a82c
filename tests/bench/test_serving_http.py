"""Issue 18's drivers on the CPU: bench/serving_http.py end to end against a stand-in `aphrodite` that streams
completions over HTTP (fake input: the server; the client, the timing and the report are the real code),
and bench/exllamav3_generator.py's argument handling (the generator itself needs the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, free_port, install_fake_aphrodite

sys.path.insert(0, str(ROOT / "bench"))
import exllamav3_generator  # noqa: E402
import serving_http  # noqa: E402

STREAMING_APHRODITE = textwrap.dedent('''\
    #!{python}
    """Stand-in for `aphrodite run MODEL --port P ...`: /health, /metrics and /v1/completions streaming max_tokens
    one-character chunks, 2 ms apart, for the model names it was started with. Faults on request, for the checks
    of bench/level_checks.py: FAKE_SERIAL=1 answers one request at a time, FAKE_CHUNK=2 streams two tokens a chunk,
    FAKE_COMPILE_AT=K writes a file into FAKE_COMPILE_DIR and logs a JIT warning at the K-th completion's 9th
    token, FAKE_PREEMPT_AT=K counts a preemption at its 5th; FAKE_TOKEN_S: the time a token takes; FAKE_TICK=1
    logs `TICK epoch` every 10 ms (a live process's heartbeat: none while it is stopped). The usage chunk when asked
    (stream_options.include_usage); with --speculative-config, FAKE_CHUNK tokens a chunk and the speculative
    counters of steps that drafted num_speculative_tokens each and had FAKE_CHUNK - 1 of them accepted."""
    import http.server, json, os, socketserver, sys, threading, time
    args = sys.argv[1:]
    env = os.environ.get
    time.sleep(float(env("FAKE_START_S", "0")))  # a slow start, as a compiling engine's
    port = int(args[args.index("--port") + 1])
    names = {args[args.index("--served-model-name") + 1]}
    if "--lora-modules" in args:
        names.add(args[args.index("--lora-modules") + 1].split("=")[0])
    print("INFO 00:00:02 GPU KV cache size: 4,321 tokens", flush=True)
    serial, state = threading.Lock(), {"posts": 0, "preempted": 0, "drafts": 0, "draft": 0, "accepted": 0}
    k = 0
    if "--speculative-config" in args:
        k = json.loads(args[args.index("--speculative-config") + 1])["num_speculative_tokens"]
    if env("FAKE_TICK"):
        def tick():
            while True:
                print(f"TICK {time.time():.4f}", flush=True); time.sleep(0.01)
        threading.Thread(target=tick, daemon=True).start()
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            if self.path == "/metrics":
                body = f'aphrodite:num_preemptions_total{{engine="0"}} {state["preempted"]}.0\\n'
                for key, name in (("drafts", "drafts"), ("draft", "draft_tokens"), ("accepted", "accepted_tokens")):
                    if k:
                        body += f'aphrodite:spec_decode_num_{name}_total{{engine="0"}} {state[key]}.0\\n'
                for j in range(k):
                    n = state["drafts"] if j < int(env("FAKE_CHUNK", "1")) - 1 else 0
                    label = f'{{engine="0",position="{j}"}}'
                    body += f'aphrodite:spec_decode_num_accepted_tokens_per_pos_total{label} {n}.0\\n'
                body = body.encode()
                self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
                self.wfile.write(body); return
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0"); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if body["model"] not in names or not body.get("ignore_eos"):
                self.send_response(404); self.send_header("content-length", "0"); self.end_headers(); return
            state["posts"] += 1
            post = state["posts"]
            if env("FAKE_SERIAL"):
                serial.acquire()
            self.send_response(200); self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close"); self.end_headers()
            per = int(env("FAKE_CHUNK", "1"))
            for i in range(0, body["max_tokens"], per):
                time.sleep(float(env("FAKE_TOKEN_S", "0.002")) * per)
                if i == 8 and str(post) == env("FAKE_COMPILE_AT"):
                    open(os.path.join(env("FAKE_COMPILE_DIR"), f"kernel-{post}.cubin"), "w").close()
                    warn = "Triton kernel JIT compilation during inference: _k. This causes a latency spike"
                    print(f"WARN {time.strftime('%H:%M:%S')} {warn}", flush=True)
                if i == 4 and str(post) == env("FAKE_PREEMPT_AT"):
                    state["preempted"] += 1
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "text": "a" * per, "finish_reason": None, "logprobs": None}]}
                if k:
                    state["drafts"] += 1; state["draft"] += k; state["accepted"] += per - 1
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode()); self.wfile.flush()
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"], "total_tokens": 1}
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"],
                         "choices": [], "usage": usage}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode()); self.wfile.flush()
            self.wfile.write(b"data: [DONE]\\n\\n"); self.wfile.flush()
            if env("FAKE_SERIAL"):
                serial.release()
        def log_message(self, *a): pass
    class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
    S(("127.0.0.1", port), H).serve_forever()
    ''')


@pytest.fixture
def streaming_aphrodite(tmp_path, monkeypatch):
    pytest.importorskip("openai")
    install_fake_aphrodite(tmp_path, monkeypatch, STREAMING_APHRODITE)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 5000}}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    return model, adapter, tmp_path


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_serving_http_measures_every_level_through_the_server(streaming_aphrodite, with_adapter):
    model, adapter, tmp = streaming_aphrodite
    out = tmp / "r.json"
    argv = [str(model), "--out", str(out), "--concurrency", "1,4", "--prompt", "8", "--output", "100"]
    argv += ["--port", str(free_port()), "--start-timeout", "60"] + (
        ["--adapter", str(adapter)] if with_adapter else []
    )
    assert serving_http.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["completed"] == row["concurrency"] and row["failed"] == 0
        assert 0 < row["ttft_mean_s"] <= row["ttft_max_s"] < row["wall_s"]
        assert 100 < row["per_request_tok_s"] < 600  # 2 ms per token, plus HTTP
    # the four streamed at once; 100 tokens (200 ms) so that a fresh client's connection set-up, which
    # varies by tens of ms between runs, cannot decide the ratio
    assert result["rows"][1]["throughput_tok_s"] > 2 * result["rows"][0]["throughput_tok_s"]
    assert result["kv_cache_tokens"] == 4321 and ("--enable-lora" in result["command"]) == with_adapter


def test_two_engines_started_at_once_measure_one_after_the_other(streaming_aphrodite):
    """The full-depth base and LoRA engines start together and take turns (ci/stages/fulldepth.sh's
    HXF_FD_PARALLEL): base measures once the LoRA engine is ready, LoRA once base is done."""
    import threading

    model, adapter, tmp = streaming_aphrodite
    files = {k: tmp / f"{k}" for k in ("base.ready", "base.done", "lora.ready", "lora.done")}
    common = [str(model), "--concurrency", "1,2", "--prompt", "8", "--output", "20", "--start-timeout", "60"]
    runs = {
        "base": [*common, "--out", str(tmp / "base.json"), "--port", str(free_port())]
        + ["--ready-file", str(files["base.ready"]), "--done-file", str(files["base.done"])]
        + ["--wait-for", str(files["lora.ready"])],
        "lora": [*common, "--out", str(tmp / "lora.json"), "--port", str(free_port()), "--adapter", str(adapter)]
        + ["--ready-file", str(files["lora.ready"]), "--done-file", str(files["lora.done"])]
        + ["--wait-for", str(files["base.done"])],
    }
    codes = {}
    threads = [threading.Thread(target=lambda k=k: codes.update({k: serving_http.main(runs[k])})) for k in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == {"base": 0, "lora": 0} and all(f.exists() for f in files.values())
    base, lora = (json.loads((tmp / f"{k}.json").read_text()) for k in ("base", "lora"))
    assert base["gate"]["missing"] == [] and lora["gate"]["missing"] == []
    assert lora["gate"]["waited_s"] > 0  # it waited for base's levels
    assert [r["completed"] for r in base["rows"]] == [1, 2] == [r["completed"] for r in lora["rows"]]


def test_a_gate_that_never_opens_is_recorded_and_the_levels_still_run(streaming_aphrodite):
    model, _, tmp = streaming_aphrodite
    never = tmp / "never"
    argv = [str(model), "--out", str(tmp / "r.json"), "--concurrency", "1", "--prompt", "8", "--output", "10"]
    argv += ["--port", str(free_port()), "--wait-for", str(never), "--wait-timeout", "1"]
    assert serving_http.main(argv) == 0
    result = json.loads((tmp / "r.json").read_text())
    assert result["gate"]["missing"] == [str(never)] and result["gate"]["waited_s"] >= 1
    assert result["rows"][0]["completed"] == 1


def test_serving_http_refuses_a_folder_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serving_http.main([str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2 and "has no config.json" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_exllamav3_generator_refuses_a_folder_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        exllamav3_generator.main([str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2 and "has no config.json" in capsys.readouterr().err


class _Generator:
    """A stand-in for exllamav3's Generator (fake input): one streaming result per job and step, 1 ms a step, the
    last with eos and the times exllamav3 1.6.5's generator/job.py emits at EOS (durations)."""

    def __init__(self, steps=11, max_active=None, max_draft_tokens=0):
        self.queue, self.steps, self.max_active = [], steps, max_active
        # a generator built with a draft model (exllamav3_generator.py --mtp): its EOS results count draft tokens as
        # generator/job.py's do, two accepted and one rejected a drafted token of the window
        self.max_draft_tokens = self.num_draft_tokens = max_draft_tokens

    def enqueue(self, job):
        self.queue.append([job, 0])

    def num_remaining_jobs(self):
        return len(self.queue)

    @property
    def active_jobs(self):  # the real generator's list of started jobs: all, or the first max_active
        return [job for job, _ in self.queue[: self.max_active]]

    def iterate(self):
        import time

        time.sleep(0.001)
        out = []
        for entry in self.queue[: self.max_active]:  # the others wait, as jobs that found no free pages
            entry[1] += 1
            job, eos = entry[0], entry[1] == self.steps
            r = {"stage": "streaming", "eos": eos, "identifier": job.identifier, "text": "a"}
            if eos:
                r.update(new_tokens=job.max_new_tokens, time_enqueued=0.5, time_prefill=0.25, time_generate=3.0)
                if self.max_draft_tokens:
                    drafted = self.num_draft_tokens
                    r.update(accepted_draft_tokens=2 * drafted, rejected_draft_tokens=drafted)
            out.append(r)
        self.queue = [e for e in self.queue if e[1] < self.steps]
        return out


class _Job:
    seen: list = []  # every job's prompt ids, for the prompt pool checks

    def __init__(self, input_ids, max_new_tokens, sampler, stop_conditions, identifier):
        self.max_new_tokens, self.identifier = max_new_tokens, identifier
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids  # [[ids]], a tensor or the fake's
        _Job.seen.append(list(ids[0]))


def test_exllamav3_generator_times_tokens_as_serving_http_does_and_keeps_its_own_job_times():
    import torch

    row = exllamav3_generator.run_level(_Generator(), _Job, None, [[1, 2], [3, 4]], 31, torch)
    assert row["completed"] == 2 and row["new_tokens"] == 62 and row["failed"] == 0
    # one formula with aphrodite's: (output - 1) over each job's first-to-last token span, 10 steps of >= 1 ms
    assert 0 < row["per_request_tok_s"] <= 30 / 0.010 and 0 < row["decode_tok_s"] <= 2 * 30 / 0.010
    assert row["ttft_mean_s"] < 0.1  # the first token's own time, not exllamav3's queue + prefill durations
    assert row["exl3_per_request_tok_s"] == 10.0  # (31 - 1) / time_generate
    assert row["exl3_ttft_mean_s"] == 0.75  # queue wait + prefill


def test_exllamav3_serve_answers_each_asked_level_and_survives_a_bad_line():
    import io

    import torch

    lines = [json.dumps({"concurrency": 3, "seed": 7, "output": 5}), "not json", json.dumps({"concurrency": 0})]
    lines.append(json.dumps({"concurrency": 1, "seed": 8, "output": 5}))
    out = io.StringIO()
    exllamav3_generator.serve(_Generator(4), _Job, None, 5000, 16, torch, io.StringIO("\n".join(lines) + "\n"), out)
    answers = out.getvalue().splitlines()
    assert [a.split(" ")[0] for a in answers] == ["LEVEL", "ERROR", "ERROR", "LEVEL"]
    assert json.loads(answers[0][6:])["completed"] == 3 and json.loads(answers[3][6:])["concurrency"] == 1


def test_exllamav3_serve_drafts_as_asked_from_the_asked_pool_and_keeps_its_own_draft_counts():
    import io

    import torch

    asks = [
        {"concurrency": 2, "seed": 7, "output": 5, "draft": 2, "pool": [250, 500]},
        {"concurrency": 1, "seed": 8, "output": 5},
        {"concurrency": 1, "seed": 9, "output": 5, "draft": 4},
    ]
    out = io.StringIO()
    _Job.seen.clear()
    generator = _Generator(4, max_draft_tokens=3)
    stdin = io.StringIO("".join(json.dumps(a) + "\n" for a in asks))
    exllamav3_generator.serve(generator, _Job, None, 5000, 16, torch, stdin, out)
    answers = out.getvalue().splitlines()
    assert [a.split(" ")[0] for a in answers] == ["LEVEL", "LEVEL", "ERROR"]  # 4 > the 3 it was built for
    drafted, plain = (json.loads(a[6:]) for a in answers[:2])
    assert drafted["draft_tokens"] == 2 and drafted["draft_acceptance"] == round(2 / 3, 4)
    assert drafted["draft_accepted"] == 8 and drafted["draft_rejected"] == 4  # two jobs
    assert "draft_tokens" not in plain and "draft_acceptance" not in plain and generator.num_draft_tokens == 0
    assert all(250 <= t < 500 for ids in _Job.seen[:2] for t in ids) and len(_Job.seen[0]) == 16
    assert any(t >= 1000 for t in _Job.seen[2])  # no pool: the ids above the special tokens


def test_prompts_from_a_pool_stay_in_it_and_are_the_same_in_every_driver():
    a = serving_http.prompts(3, 20, 5000, seed=4, pool=(0, 250))
    assert a == exllamav3_generator.prompts(3, 20, 5000, seed=4, pool=(0, 250))
    assert all(0 <= t < 250 for p in a for t in p) and a != serving_http.prompts(3, 20, 5000, seed=4)


def test_both_drivers_send_the_same_prompts():
    assert (
        serving_http.prompts is exllamav3_generator.prompts
        and serving_http.level_seed is exllamav3_generator.level_seed
        and serving_http.figures is exllamav3_generator.figures
    )
    assert all(1000 <= t < 5000 for p in serving_http.prompts(3, 16, 5000) for t in p)


def test_no_measured_level_repeats_a_prompt_of_another_or_of_the_warm_up():
    """aphrodite 0.23.0+ cache prefixes of hybrid models by default, in whole attention blocks
    (docs/upstream/hybrid-prefix-caching-state-blocks.md): a prompt seen at an earlier level is answered from cache in
    part, and more so with a bfloat16 state's 400-token block than a float32 state's 784-token one."""
    seen = {}
    for rep in range(3):
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for ids in serving_http.prompts(n, 400, 248_320, seed=serving_http.level_seed(n, rep)):
                assert tuple(ids[:16]) not in seen, f"level {n} repeat {rep} repeats level {seen[tuple(ids[:16])]}"
                seen[tuple(ids[:16])] = (n, rep)
    for warm in (98, 99):  # same_run.py's and serving_http.py's warm-up prompts
        assert all(tuple(ids[:16]) not in seen for ids in serving_http.prompts(256, 16, 248_320, seed=warm))


def test_fulldepth_report_ratios_and_goals(tmp_path):
    """Synthetic results (fake inputs) in the layout ci/stages/fulldepth.sh writes; the 9B's real
    header table from run 11 for the roofline."""
    import fulldepth_report

    res = tmp_path / "res"
    res.mkdir()
    inputs = ROOT / "docs" / "gpu-runs" / "2026-12-01-run11" / "cal" / "inputs-9b-exl3.json"
    (res / "inputs-qwen3.5-9b-full-exl3.json").write_text(inputs.read_text())
    (res / "bandwidth.json").write_text(json.dumps({"copy_bandwidth_gbps": 4000.0}))

    def rows(scale):
        return [
            {
                "concurrency": n,
                "decode_tok_s": scale * 50 * n,
                "throughput_tok_s": scale**2 * 45 * n,
                "per_request_tok_s": scale * 50,
                "ttft_mean_s": 0.1,
            }
            for n in (1, 32)
        ]

    for name, scale in (("aphrodite-base", 1.2), ("aphrodite-lora", 1.14), ("exllamav3", 1.0)):
        (res / f"qwen3.5-9b-full-{name}.json").write_text(
            json.dumps({"prompt": 512, "output": 256, "rows": rows(scale)})
        )
    assert fulldepth_report.main([str(res), "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "fulldepth.md").read_text()
    assert "N = 1, Aphrodite / exllamav3 per-request speed >= 1: 1.2 (met)" in table
    assert "N = 32, Aphrodite / exllamav3 decode throughput >= 5: 1.2 (not met)" in table
    assert "N = 32, Aphrodite / exllamav3 end-to-end throughput (prefill included) >= 5: 1.44 (not met)" in table
    assert "N = 1, adapter cost < 10 %: 0.05 (met)" in table
    got = {r["concurrency"]: r for r in fulldepth_report.table(res, "qwen3.5-9b-full")}
    assert got[1]["aphrodite_over_roofline"] == round(60 / got[1]["roofline_tok_s"], 3)


def test_fulldepth_report_takes_what_a_run_lacks_from_another_and_names_it(tmp_path, capsys):
    """Run 14's layout: this run's base and LoRA engines, another run's inputs table and exllamav3 rows."""
    import fulldepth_report

    this, other = tmp_path / "this", tmp_path / "other"
    for folder in (this, other):
        folder.mkdir()
        (folder / "bandwidth.json").write_text(json.dumps({"copy_bandwidth_gbps": 4000.0}))
    inputs = ROOT / "docs" / "gpu-runs" / "2026-12-01-run11" / "cal" / "inputs-9b-exl3.json"
    (other / "inputs-qwen3.5-9b-full-exl3.json").write_text(inputs.read_text())
    for folder, name, decode in (
        (this, "aphrodite-base", 100.0),
        (this, "aphrodite-lora", 80.0),
        (other, "exllamav3", 50.0),
    ):
        (folder / f"qwen3.5-9b-full-{name}.json").write_text(
            json.dumps({"rows": [{"concurrency": 32, "decode_tok_s": decode, "throughput_tok_s": decode}]})
        )
    assert fulldepth_report.main([str(this), "--out", str(tmp_path / "out"), "--fallback", str(other)]) == 0
    table = (tmp_path / "out" / "fulldepth.md").read_text()
    assert f"From another run (ratios on them are across runs): `{other / 'qwen3.5-9b-full-exllamav3.json'}`" in table
    assert "N = 32, Aphrodite / exllamav3 decode throughput >= 5: 2.0 (not met)" in table
    assert "N = 32, adapter cost < 10 %: 0.2 (not met)" in table
    # without the fallback there is no inputs table to compute the roofline from: a message, no traceback
    with pytest.raises(SystemExit) as exit_info:
        fulldepth_report.main([str(this), "--out", str(tmp_path / "out2")])
    assert exit_info.value.code == 2 and "inputs-qwen3.5-9b-full-exl3.json is missing" in capsys.readouterr().err


def test_fulldepth_report_refuses_a_folder_that_is_not_a_result(tmp_path, capsys):
    import fulldepth_report

    with pytest.raises(SystemExit) as exit_info:
        fulldepth_report.main([str(tmp_path)])
    assert exit_info.value.code == 2 and "bandwidth.json" in capsys.readouterr().err


def test_fulldepth_script_starts_both_engines_and_measures_only_after_its_gate(streaming_aphrodite, tmp_path):
    """ci/stages/fulldepth.sh with HXF_FD_PARALLEL=1 against the stand-in server (fake input): both
    engines start at once, neither measures before the gate file exists, base measures before LoRA, and
    without a GPU no empty bandwidth.json is left to be skipped on (run 14's script went on beside other work
    after its engines failed, and a failed measurement left a file behind)."""
    import os
    import threading
    import time

    _, _, stub = streaming_aphrodite
    site = tmp_path / "site"
    (site / "bin").mkdir(parents=True)
    os.symlink(stub / "bin" / "aphrodite", site / "bin" / "aphrodite")
    (site / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this venv's, not a link
    (site / "bin" / "python3").chmod(0o755)
    model = tmp_path / "models" / "qwen3.6-27b-full"
    (model / "exl3").mkdir(parents=True)
    (model / "lora-a").mkdir()
    (model / "manifest.json").write_text("{}")
    (model / "exl3" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 5000}}))
    (model / "lora-a" / "adapter_config.json").write_text("{}")
    out, gate = tmp_path / "out" / "fulldepth", tmp_path / "gate"
    env = {
        **os.environ,
        "HXF_SITE": str(site),
        "HXF_FD_OUT": str(out),
        "HXF_FD_MODELS": str(tmp_path / "models"),
        "HXF_FD_PARALLEL": "1",
        "HXF_FD_NO_INSTALL": "1",
        "HXF_FD_KINDS": "base lora",
        "HXF_FD_CONCURRENCY": "1,2",
        "HXF_FD_GATE": str(gate),
        "HXF_FD_PORT": str(free_port()),
        "HXF_FD_SECONDS": "300",
    }
    opened = threading.Timer(6.0, gate.touch)
    opened.start()
    t0 = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "ci" / "stages" / "fulldepth.sh")], env=env, capture_output=True, text=True, timeout=240
    )
    opened.cancel()
    assert done.returncode == 0, done.stderr[-2000:]
    base, lora = (json.loads((out / f"qwen3.6-27b-full-aphrodite-{k}.json").read_text()) for k in ("base", "lora"))
    said = {f.name: f.read_text()[-600:] for f in out.glob("*.stdout")}
    assert "rows" in base and "rows" in lora, (base, lora, said, done.stdout[-1000:])
    assert [r["completed"] for r in base["rows"]] == [1, 2] == [r["completed"] for r in lora["rows"]]
    assert "--kv-cache-memory-bytes" in base["command"] and "--enable-lora" in lora["command"]
    assert base["gate"]["missing"] == [] and base["gate"]["waited_s"] > 0  # it waited for the gate file
    assert time.monotonic() - t0 > 6.0
    assert lora["gate"]["waited_s"] > 0  # and LoRA for base's levels
    assert not (out / "bandwidth.json").exists() and not (out / "bandwidth.tmp").exists()
    assert not (out / "qwen3.6-27b-full-exllamav3.json").exists()  # not among HXF_FD_KINDS
