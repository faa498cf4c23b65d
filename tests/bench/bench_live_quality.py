"""Live routing quality with a real load client: kvroute vs sglang-router and vllm-router.

    flock /tmp/bench.lock ip netns exec bench \\
        python tests/bench/bench_live_quality.py --aiperf /tmp/aiperf-venv/bin/aiperf --rounds 3

For every target, and again in every round, this starts ``--pods`` fresh simulated vLLM
pods (``kvroute sim`` with a real TTFT model: ``--time-scale 1``, a prefill rate, a small
KV cache, so a prefix-cache hit shortens TTFT), then the target router in front of them,
and drives it with **aiperf** (NVIDIA's load client; installed in its own venv, given by
``--aiperf``): multi-turn streaming chat, ``--conversations`` conversations of ``--turns``
turns whose first message starts with one of ``--prefix-prompts`` shared prefixes of
``--prefix-length`` tokens; history accumulates turn by turn; ``--turn-delay-ms`` of user
think time between turns.  The same aiperf seed is used for every target of a round, so
every target gets the very same conversations.

Targets (a peer that is not installed is skipped with a note):

* ``kvroute cost``          — ``kvroute serve`` (default policy ``cost``, KV events from the
                              pods, the pods' own tokenizer directory);
* ``kvroute round_robin``   — the same with ``--policy round_robin``;
* ``sglang cache_aware`` / ``sglang round_robin``           — ``sglang-router``;
* ``vllm-router cache_aware`` / ``vllm-router round_robin`` — ``vllm-router``.

Measured per run:

* TTFT p50 / p90 / p99 and request throughput as aiperf reports them (its JSON export);
* errors: aiperf's error count + requests the pods rejected;
* prefix hit rate from the pods' own counters: sum of ``vllm:prefix_cache_hits_total``
  over sum of ``vllm:prefix_cache_queries_total``, deltas over the run (hits and queries
  are tokens, as in vLLM);
* request share: requests finished per pod (``vllm:request_success_total`` deltas),
  imbalance = max / mean;
* CPU used during the run (cores = CPU seconds / wall seconds) by the pods, by the router
  and by aiperf, to show whether the 2-core machine was the bottleneck.

The table gives the median over ``--rounds``; ``--json-out`` keeps every run.  The pods'
prefix caches are reset (``POST /reset_prefix_cache``) after the router answered its
readiness probe and before aiperf starts, so each run starts with empty caches.

Send traffic only to 127.0.0.1: run it in a loopback-only network namespace
(``ip netns add bench; ip netns exec bench ip link set lo up``).  aiperf fails with
``HF_HUB_OFFLINE=1`` set, so it is removed from aiperf's environment; the Rust routers get
``HF_HUB_OFFLINE=1 HF_ENDPOINT=http://127.0.0.1:9`` (``peer_routers.PEER_ENV``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_router_overhead import (
    Proc,
    cpu_seconds,
    free_port,
    start_sglang,
    start_vllm_router,
    wait_completion,
    wait_http,
)
from peer_routers import peer_tools
from source_tree import tree_cwd
from unwind import unwind_on_sigterm

from scoring.policies import available_policies

MODEL = "sim-model"

TARGETS = [
    "kvroute cost",
    "kvroute round_robin",
    "sglang cache_aware",
    "sglang round_robin",
    "vllm-router cache_aware",
    "vllm-router round_robin",
]
#: ``--targets`` may also name any other kvroute policy ("kvroute dynamo", ...)
CHOICES = TARGETS + [f"kvroute {p}" for p in available_policies() if f"kvroute {p}" not in TARGETS]

# -- the tokenizer directory shared by aiperf, the pods and kvroute ----------------------

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab: int = 8192) -> Path:
    """A byte-level BPE trained on local text (no hub), saved as a transformers
    ``PreTrainedTokenizerFast`` directory with a chat template (as ../shared/PEERS.md and
    ../shared/vllm-cpu/make_tiny_model.py do).  Reused when ``out`` already holds one."""
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:120]
    files = [f for f in files if os.path.isfile(f)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS, UNK, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=32768,
    )
    hf.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


# -- pods ------------------------------------------------------------------------------------


@dataclass
class Pod:
    proc: Proc
    url: str
    events_endpoint: str
    replay_endpoint: str


def simple_pod_argv(args: argparse.Namespace) -> list[str]:
    """The pod model's options: ``kvroute sim``'s simple model with a real TTFT model."""
    return [
        *["--time-scale", "1", "--prefill-rate", str(args.prefill_rate)],
        *["--capacity-tokens", str(args.capacity_tokens), "--max-batch", str(args.max_batch)],
        *["--output-tokens", str(args.output_tokens)],
    ]


def start_pod(
    i: int,
    args: argparse.Namespace,
    tokenizer: Path,
    logdir: Path,
    model_argv: list[str] | None = None,
) -> Pod:
    """One ``kvroute sim`` pod; ``model_argv`` (default :func:`simple_pod_argv`) sets its
    pod model and time model."""
    # under uvloop, as bench_router_overhead.start_sim does (TCP_NODELAY on accepted sockets)
    code = "import sys, uvloop; uvloop.install(); from router.cli import main; sys.exit(main())"
    argv = [
        *["sim", "--port", "0", "--pod-name", f"sim-{i}", "--model", MODEL],
        *(simple_pod_argv(args) if model_argv is None else model_argv),
        *["--tokenizer", str(tokenizer)],
    ]
    with open(logdir / f"sim-{i}.log", "ab") as err:
        p = subprocess.Popen(
            [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=err
        )
    assert p.stdout is not None
    info = json.loads(p.stdout.readline())
    return Pod(
        Proc(f"sim-{i}", p),
        str(info["url"]),
        str(info["events_endpoint"]),
        str(info["replay_endpoint"]),
    )


def scrape(url: str) -> dict[str, float]:
    """The pod's counters this bench reads, summed over label sets."""
    names = (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:request_success_total",
        "kvroute_sim_rejected_requests_total",
    )
    out = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def reset_cache(url: str) -> None:
    req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


# -- targets ---------------------------------------------------------------------------------


def static_pods(pods: list[Pod]) -> list[dict[str, object]]:
    """``discovery.static`` for ``pods`` (``sim-<i>``, with their KV event endpoints)."""
    return [
        {
            "name": f"sim-{i}",
            "url": p.url,
            "events_endpoint": p.events_endpoint,
            "replay_endpoint": p.replay_endpoint,
            "models": [MODEL],
        }
        for i, p in enumerate(pods)
    ]


def start_kvroute(
    pods: list[Pod],
    policy: str,
    tokenizer: Path,
    logdir: Path,
    policy_params: dict[str, object] | None = None,
    env_extra: dict[str, str] | None = None,
) -> tuple[Proc, int]:
    """``kvroute serve --policy POLICY`` over ``pods`` with KV events; ``policy_params``
    go to ``--policy-params``, ``env_extra`` into its environment (e.g. ``PYTHONPATH`` of
    another checkout)."""
    port = free_port()
    static = static_pods(pods)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update(env_extra or {})
    params = ["--policy-params", json.dumps(policy_params)] if policy_params else []
    with open(logdir / f"kvroute-{policy}.log", "ab") as err:
        p = subprocess.Popen(
            [
                *[sys.executable, "-m", "router.cli", "serve", "--port", str(port)],
                *["--log-level", "warning", "--policy", policy, "--tokenizer", str(tokenizer)],
                *["--discovery.static", json.dumps(static), *params],
            ],
            env=env,
            cwd=tree_cwd((env_extra or {}).get("PYTHONPATH")),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    proc = Proc(f"kvroute {policy}", p)
    try:
        wait_http(port, "/ready")
        wait_completion(port)
    except BaseException:
        proc.stop()
        raise
    return proc, port


def start_target(
    name: str,
    pods: list[Pod],
    tokenizer: Path,
    logdir: Path,
    peers: tuple[str | None, str | None],
) -> tuple[Proc, int] | None:
    """``name``'s router in front of ``pods``; None for a peer that is not installed
    (``peers``: :func:`peer_routers.peer_tools`' answer)."""
    kind, policy = name.split(" ")
    urls = [p.url for p in pods]
    if kind == "kvroute":
        return start_kvroute(pods, policy, tokenizer, logdir)
    sglang, vllm = peers
    if kind == "sglang":
        return start_sglang(sglang, urls, policy)
    if kind == "vllm-router":
        return start_vllm_router(vllm, urls, policy)
    raise ValueError(name)


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Run:
    target: str
    round: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    req_per_s: float
    requests: int
    errors: int
    hit_rate: float
    ceiling: float
    per_pod: list[int]
    imbalance: float
    wall_s: float
    pods_cores: float
    router_cores: float
    client_cores: float
    load_avg: float


def aiperf_argv(
    args: argparse.Namespace, tokenizer: Path, port: int, seed: int, out: Path
) -> list[str]:
    return [
        *[args.aiperf, "profile", "--model", MODEL, "--tokenizer", str(tokenizer)],
        *["--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat", "--streaming"],
        *["--num-prefix-prompts", str(args.prefix_prompts)],
        *["--prefix-prompt-length", str(args.prefix_length)],
        *["--conversation-num", str(args.conversations)],
        *["--conversation-turn-mean", str(args.turns)],
        *["--conversation-turn-delay-mean", str(args.turn_delay_ms)],
        *["--conversation-turn-delay-stddev", str(args.turn_delay_ms // 4)],
        *["--isl", str(args.isl), "--concurrency", str(args.concurrency)],
        *["--concurrency-ramp-duration", str(args.ramp_s)],
        *["--workers-max", str(args.aiperf_workers), "--random-seed", str(seed)],
        *["--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics"],
    ]


def run_one(
    args: argparse.Namespace,
    name: str,
    rnd: int,
    tokenizer: Path,
    workdir: Path,
    peers: tuple[str | None, str | None],
) -> Run | None:
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        pods = []
        for i in range(args.pods):
            pod = start_pod(i, args, tokenizer, logdir)
            procs.append(pod.proc)
            pods.append(pod)
        for pod in pods:
            wait_http(int(pod.url.rsplit(":", 1)[1]))
        started = start_target(name, pods, tokenizer, logdir, peers)
        if started is None:
            return None
        router, port = started
        procs.append(router)
        for pod in pods:  # the readiness probe went through: every run starts empty
            reset_cache(pod.url)
        time.sleep(1.0)  # AllBlocksCleared reaches kvroute's index

        out = workdir / f"r{rnd}-{name.replace(' ', '-')}"
        env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
        before = [scrape(p.url) for p in pods]
        pod_pids = [p.proc.popen.pid for p in pods]
        cpu0 = (cpu_seconds(pod_pids), cpu_seconds([router.popen.pid]))
        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        with open(logdir / f"aiperf-{out.name}.log", "wb") as log:
            rc = subprocess.run(
                aiperf_argv(args, tokenizer, port, args.seed + rnd, out),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                check=False,
            ).returncode
        wall = time.monotonic() - t0
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu1 = (cpu_seconds(pod_pids), cpu_seconds([router.popen.pid]))
        load_avg = os.getloadavg()[0]
        after = [scrape(p.url) for p in pods]
        if rc != 0:
            raise RuntimeError(f"aiperf exited {rc}: see {logdir}/aiperf-{out.name}.log")
        if router.popen.poll() is not None:
            raise RuntimeError(f"{name} exited during the run ({router.popen.returncode})")
        report = json.loads((out / "profile_export_aiperf.json").read_text())

        def delta(key: str) -> list[float]:
            return [a[key] - b[key] for a, b in zip(after, before, strict=True)]

        hits = sum(delta("vllm:prefix_cache_hits_total"))
        queries = sum(delta("vllm:prefix_cache_queries_total"))
        per_pod = [int(x) for x in delta("vllm:request_success_total")]
        rejected = int(sum(delta("kvroute_sim_rejected_requests_total")))
        ttft = report["time_to_first_token"]
        aiperf_errors = sum(int(e.get("count", 0)) for e in report.get("error_summary") or [])
        mean = statistics.mean(per_pod) if per_pod else 0.0
        return Run(
            target=name,
            round=rnd,
            ttft_p50_ms=float(ttft["p50"]),
            ttft_p90_ms=float(ttft["p90"]),
            ttft_p99_ms=float(ttft["p99"]),
            req_per_s=float(report["request_throughput"]["avg"]),
            requests=int(report["request_count"]["avg"]),
            errors=aiperf_errors + rejected,
            hit_rate=hits / queries if queries else 0.0,
            ceiling=ceiling_hit_rate(out, args.prefix_length),
            per_pod=per_pod,
            imbalance=max(per_pod) / mean if mean else 0.0,
            wall_s=wall,
            pods_cores=(cpu1[0] - cpu0[0]) / wall,
            router_cores=(cpu1[1] - cpu0[1]) / wall,
            client_cores=(kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime) / wall,
            load_avg=load_avg,
        )
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()


def ceiling_hit_rate(out: Path, prefix_length: int, block_size: int = 16) -> float:
    """The hit rate of one infinite cache shared by all pods, estimated from aiperf's own
    records (``inputs.json``, ``profile_export.jsonl``): turn 0 can hit its shared prefix
    (``prefix_length`` tokens) once an earlier conversation sent the same one; turn k can
    hit everything turn k - 1 computed (its prompt and its answer); block-aligned, and the
    last prompt token always recomputed (as vLLM and the sim pods count)."""
    inputs = json.loads((out / "inputs.json").read_text())["data"]
    first = {s["session_id"]: s["payloads"][0]["messages"][0]["content"][:300] for s in inputs}
    rows = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["metadata"]["request_start_ns"])
    seen: set[str] = set()
    computed: dict[str, int] = {}
    hits = queries = 0
    for r in rows:
        if "usage_prompt_tokens" not in r["metrics"]:  # a failed request: no usage
            continue
        conv, turn = r["metadata"]["conversation_id"], r["metadata"]["turn_index"]
        prompt = int(r["metrics"]["usage_prompt_tokens"]["value"])
        answer = int(r["metrics"]["usage_completion_tokens"]["value"])
        if turn == 0:
            can = prefix_length if first[conv] in seen else 0
            seen.add(first[conv])
        else:
            can = computed.get(conv, 0)
        hits += min(can, prompt - 1) // block_size * block_size
        queries += prompt
        computed[conv] = prompt + answer - 1
    return hits / queries if queries else 0.0


# -- main ------------------------------------------------------------------------------------


def print_table(runs: list[Run], targets: list[str]) -> None:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    print(
        "| target | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | hit rate | "
        "ceiling | imbalance | requests per pod | errors | CPU pods / router / aiperf (cores) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for t in targets:
        rs = [r for r in runs if r.target == t]
        if not rs:
            continue
        shares = "; ".join("/".join(str(n) for n in r.per_pod) for r in rs)
        print(
            f"| {t} | {med([r.ttft_p50_ms for r in rs]):.1f} |"
            f" {med([r.ttft_p90_ms for r in rs]):.1f} | {med([r.ttft_p99_ms for r in rs]):.1f} |"
            f" {med([r.req_per_s for r in rs]):.2f} | {med([r.hit_rate for r in rs]):.3f} |"
            f" {med([r.ceiling for r in rs]):.3f} |"
            f" {med([r.imbalance for r in rs]):.2f} | {shares} |"
            f" {sum(r.errors for r in rs)} |"
            f" {med([r.pods_cores for r in rs]):.2f} / {med([r.router_cores for r in rs]):.2f}"
            f" / {med([r.client_cores for r in rs]):.2f} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf", help="aiperf executable")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer directory for aiperf, the pods and kvroute (built if not given)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="artifacts (default: a temp dir)")
    ap.add_argument(
        "--peer-python",
        default=sys.executable,
        help="python with sglang_router; vllm-router beside it, else on PATH (default: this one)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--targets", nargs="+", default=TARGETS, choices=CHOICES, metavar="TARGET")
    ap.add_argument("--json-out", type=Path, default=None, help="write every run as JSON")
    g = ap.add_argument_group("pods")
    g.add_argument("--pods", type=int, default=4)
    g.add_argument("--prefill-rate", type=float, default=20000.0)
    g.add_argument("--capacity-tokens", type=int, default=49152)
    g.add_argument("--max-batch", type=int, default=32)
    g.add_argument("--output-tokens", type=int, default=8)
    g = ap.add_argument_group("aiperf workload")
    g.add_argument("--conversations", type=int, default=50)
    g.add_argument("--turns", type=int, default=10)
    g.add_argument("--prefix-prompts", type=int, default=5)
    g.add_argument("--prefix-length", type=int, default=1000)
    g.add_argument("--isl", type=int, default=300, help="tokens of each user turn")
    g.add_argument("--turn-delay-ms", type=int, default=6000, help="mean think time")
    g.add_argument("--concurrency", type=int, default=50)
    g.add_argument("--ramp-s", type=float, default=10.0, help="concurrency ramp-up, seconds")
    g.add_argument("--aiperf-workers", type=int, default=4)
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--timeout", type=float, default=900.0, help="per aiperf run, seconds")
    args = ap.parse_args()
    unwind_on_sigterm()  # every run's `finally` stops the pods, the router and aiperf

    if not Path(args.aiperf).exists():
        print(f"aiperf not found at {args.aiperf}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="live-quality-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or build_tokenizer(workdir / "tokenizer")
    print(f"# workdir {workdir}, tokenizer {tokenizer}", file=sys.stderr)

    peers = peer_tools(args.peer_python)  # (a subprocess: once, not per run)
    runs: list[Run] = []
    skipped: set[str] = set()
    for rnd in range(args.rounds):
        order = args.targets if rnd % 2 == 0 else list(reversed(args.targets))
        for name in order:
            if name in skipped:
                continue
            run = run_one(args, name, rnd, tokenizer, workdir, peers)
            if run is None:
                print(f"# skipped {name}: not installed", file=sys.stderr)
                skipped.add(name)
                continue
            runs.append(run)
            print(f"# {json.dumps(asdict(run))}", file=sys.stderr, flush=True)
            if args.json_out:
                args.json_out.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    print_table(runs, args.targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
