"""lm-evaluation-harness against fly-daemon's HTTP front: its `local-completions` model on a log-likelihood
task and a generate-until task, its `local-chat-completions` model on the generate-until task.

The tasks are tiny and local (five items in a JSON-lines file and two task YAMLs, written into a temporary
directory; no dataset or model is downloaded: HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set). lm-eval runs
as a user runs it, `python -m lm_eval run ...` in a subprocess, against a daemon started with `--http`. The
checks: every run exits 0, every task has its metric, and the daemon counted no failed request. The
log-likelihood task scores the prompt with `echo` + `logprobs` (docs/daemon.md's OpenAI section); lm-eval
counts the context with the model's own tokenizer (`tokenizer=`, a local HF directory) and sends text
(`tokenized_requests=False`: the front takes a prompt string, not token ids).

    python benchmarks/serving/lm_eval_check.py                                  # tiny random pair, exact mode
    python benchmarks/serving/lm_eval_check.py --quantization none --out benchmarks/results/lm-eval/tiny
    python benchmarks/serving/lm_eval_check.py --target DIR --draft DIR --loose
    python benchmarks/serving/lm_eval_check.py --embedded --dtype auto --loose     # the embedded pair, as served

Needs `lm-eval` (pip install lm-eval; not a fly-llm extra: see benchmarks/results/lm-eval/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.serving.serve_bench import add_model_arguments, resolve_models, start_daemon
from benchmarks.serving.webui_check import free_port, get_json, request_counts
from fly_llm.model.embedded import ensure_default_pair

ITEMS = [
    {"question": "what is 2 + 3?", "choices": ["5", "6"], "answer": 0},
    {"question": "what is 7 * 6?", "choices": ["13", "42"], "answer": 1},
    {"question": "what does the quick brown fox jump over?", "choices": ["the lazy dog", "the sun"], "answer": 0},
    {"question": "what drafts tokens in speculative decoding?", "choices": ["a large model", "a small model"],
     "answer": 1},
    {"question": "what answers questions from documents?", "choices": ["retrieval augmented generation",
                                                                      "a stack"], "answer": 0},
]
"""The five items: a question and two answers; the log-likelihood task scores both (lm-eval puts a space
before each), the generate-until task wants the right one."""

LOGLIKELIHOOD_TASK = "fly_loglikelihood"
GENERATE_TASK = "fly_generate"
TASK_YAML = {
    LOGLIKELIHOOD_TASK: """\
task: fly_loglikelihood
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    GENERATE_TASK: """\
task: fly_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data}"}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
metric_list:
  - metric: exact_match
    ignore_case: true
    regexes_to_ignore: ['^\\s+', '\\.$']
""",
}
"""lm-eval task configs; `{data}` is the JSON-lines file's path."""


@dataclass
class Run:
    """One lm-eval run against the front, and what the checks found."""

    model: str
    tasks: list[str]
    command: list[str]
    returncode: int
    seconds: float
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    ok_requests: int = 0
    failed_requests: int = 0
    results_file: str | None = None

    @property
    def passed(self) -> bool:
        """lm-eval exited 0, every task has a metric, and the daemon refused nothing."""
        return self.returncode == 0 and all(self.metrics.get(t) for t in self.tasks) \
            and self.ok_requests > 0 and not self.failed_requests


RUNS = (
    ("local-completions", "/v1/completions", [LOGLIKELIHOOD_TASK, GENERATE_TASK]),
    ("local-chat-completions", "/v1/chat/completions", [GENERATE_TASK]),
)
"""(lm-eval model, the front's route it calls, its tasks)."""


def write_tasks(directory: Path) -> Path:
    """The items as JSON lines and the task YAMLs in `directory` (lm-eval's --include_path); returns it."""
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    for name, text in TASK_YAML.items():
        (directory / f"{name}.yaml").write_text(text.format(data=data))
    return directory


def lm_eval_command(model: str, url: str, served: str, tokenizer: str, tasks: list[str], task_dir: Path,
                    output: Path) -> list[str]:
    """The `lm_eval run` command line for one model type against the front at `url` (the route itself)."""
    args = [f"model={served}", f"base_url={url}", "num_concurrent=1", "max_retries=1", "timeout=600"]
    if model == "local-completions":
        args += ["tokenizer_backend=huggingface", f"tokenizer={tokenizer}", "tokenized_requests=False"]
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", ",".join(args),
               "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--output_path", str(output),
               "--log_samples", "--seed", "1234"]
    return command + (["--apply_chat_template"] if model == "local-chat-completions" else [])


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {"metric,filter": value}} from lm-eval's results JSON (stderr and sample counts left out)."""
    return {task: {k: v for k, v in values.items() if "," in k and "_stderr" not in k}
            for task, values in results["results"].items()}


def offline_env() -> dict[str, str]:
    """This environment with Hugging Face's hub and datasets offline (nothing is downloaded)."""
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def run_lm_eval(model: str, route: str, tasks: list[str], front: str, metrics_url: str, tokenizer: str,
                task_dir: Path, workdir: Path) -> Run:
    """One `lm_eval run` against the front, its results read back and the daemon's counts around it."""
    served = get_json(f"{front}/v1/models")["data"][0]["id"]
    output = workdir / f"out-{model}"
    command = lm_eval_command(model, front + route, served, tokenizer, tasks, task_dir, output)
    before = request_counts(metrics_url)
    start = time.monotonic()
    with open(workdir / f"{model}.log", "wb") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=offline_env(),
                              timeout=900).returncode
    seconds = time.monotonic() - start
    after = request_counts(metrics_url)
    files = sorted(output.rglob("results_*.json"))
    run = Run(model, tasks, command, code, round(seconds, 1), results_file=str(files[-1]) if files else None,
              ok_requests=int(after.get("ok", 0) - before.get("ok", 0)),
              failed_requests=int(sum(after.get(k, 0) - before.get(k, 0) for k in after
                                      if k not in ("ok", "completion_tokens"))))
    if files:
        run.metrics = task_metrics(json.loads(files[-1].read_text()))
    elif code:
        sys.stderr.write((workdir / f"{model}.log").read_text(errors="replace")[-4000:])
    return run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--tokenizer", help="HF tokenizer directory for lm-eval's context counts (default: the target's)")
    p.add_argument("--loose", action="store_true", help="the daemon in FLy's loose mode (default: exact)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "w4a8", "int8", "int4"],
                   help="the daemon's --target-quantization and --draft-quantization ('none': the float "
                        "target's own log-probabilities)")
    p.add_argument("--out", type=Path, help="copy lm-eval's output (results and samples) into this directory")
    p.set_defaults(concurrency=[1])  # start_daemon's --max-batch-size
    args = p.parse_args(argv)
    args.exact = not args.loose
    return args


def run_check(args: argparse.Namespace) -> list[Run]:
    """Serve `args`' models with the HTTP front; run lm-eval's completions and chat models against it."""
    with tempfile.TemporaryDirectory(prefix="fly-lm-eval-") as tmp:
        workdir = Path(tmp)
        target, draft = resolve_models(args, workdir)
        tokenizer = args.tokenizer or target or str(ensure_default_pair()[0])
        task_dir = workdir / "tasks"
        task_dir.mkdir()
        write_tasks(task_dir)
        http_port, metrics_port = free_port(), free_port()
        daemon, _ = start_daemon(target, draft, args, workdir,
                                 ("--http", f"127.0.0.1:{http_port}", "--metrics-port", str(metrics_port),
                                  "--target-quantization", args.quantization,
                                  "--draft-quantization", args.quantization))
        try:
            runs = [run_lm_eval(model, route, tasks, f"http://127.0.0.1:{http_port}",
                                f"http://127.0.0.1:{metrics_port}/metrics", tokenizer,
                                task_dir, workdir) for model, route, tasks in RUNS]
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        if args.out:
            for run in runs:
                copy_output(run, workdir, args.out)
        return runs


def copy_output(run: Run, workdir: Path, out: Path) -> None:
    """lm-eval's results and samples for `run`, flat in `out/<model>/` (its path in `run` rewritten to the copy)."""
    dest = out / run.model
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for file in (workdir / f"out-{run.model}").rglob("*.json*"):
        shutil.copy(file, dest / file.name)
    if run.results_file:
        run.results_file = str(dest / Path(run.results_file).name)


def main(argv: list[str] | None = None) -> int:
    """Run the check; print its runs as JSON; exit 1 when a check failed."""
    runs = run_check(parse_args(argv))
    print(json.dumps([asdict(r) | {"passed": r.passed} for r in runs], indent=2))
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
