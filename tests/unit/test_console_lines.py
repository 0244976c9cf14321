"""Which of a child's output lines the launcher's console shows, how lines are recognised as
ready lines in either log format, and how output is split into lines. Runs nothing."""

from __future__ import annotations

import json
import logging

import pytest

from services.launch.output_filter import LineSplitter, OutputFilter, parse
from services.launch.readiness import ready_pattern
from services.mesh.logs import JsonFormatter, LogComponent, TextFormatter

# -- which lines reach the console --------------------------------------------------------------

SHOWN = [
    "2026-11-22 02:40:11,186 WARNING kv-router kv_router: serving without the cached blocks of 1 decode-worker(s)",
    "2026-11-22 02:40:11,186 WARNING decode-worker services.mesh.discovery: watch on /kvmesh/x/ broke; relisting",
    "2026-11-22 02:40:11,186 ERROR frontend frontend: unhandled KeyError on POST /v1/completions: 'x'",
    "2026-11-22 02:40:11,186 ERROR decode-worker vllm.v1.engine.core: EngineCore failed to start.",
    '{"ts": "2026-11-22T02:40:11.186Z", "level": "ERROR", "component": "kv-router", "logger": "x", "msg": "boom"}',
    '{"ts": "2026-11-22T02:40:11.186Z", "level": "WARNING", "component": "kv-router", "logger": "kv_router", '
    '"msg": "slow"}',
    '{"level":"error","ts":"2026-11-22T02:36:08.986Z","caller":"etcdserver/server.go:1","msg":"failed to apply"}',
    "(EngineCore_DP0 pid=812) ERROR 11-22 02:40:11 [core.py:7] EngineCore failed to start.",
    "ERROR:    Exception in ASGI application",
    "E1122 02:36:01.835408   12345 server.cc:123] something failed",
    "error: --model /x: no config.json there (expected a Hugging Face model directory)",
    "Fatal Python error: Segmentation fault",
]
HIDDEN = [
    "2026-11-22 02:40:11,186 INFO kv-router kv_router: router d3705ade18f1bd73 (kv mode) at 127.0.0.1:46433",
    '{"ts": "2026-11-22T02:40:11.186Z", "level": "INFO", "component": "processor", "logger": "processor", '
    '"msg": "processor x for m at h:1"}',
    "raft2026/11/22 02:36:01 INFO: bdae9bbc11dd390d became leader at term 2",
    "INFO 11-22 02:40:11 [core.py:7] init engine (profile, create kv cache, warmup model) took 3.1 seconds",
    "(EngineCore_DP0 pid=812) DEBUG 11-22 02:40:11 [core.py:7] waiting for work",
    "decode-worker ready: ba620ad452e872c5",
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 257.27it/s]",
    "/x/site-packages/torch/cuda/__init__.py:61: FutureWarning: the pynvml package is deprecated.",
    # Libraries' warnings: about their own set-up, dozens at every start.
    "2026-11-22 02:44:57,509 WARNING decode-worker vllm.triton_utils.importing: Triton is installed, but no CPU backend.",
    "(Worker pid=13342) WARNING 11-22 02:45:11 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
    '{"ts": "2026-11-22T02:40:11.186Z", "level": "WARNING", "component": "decode-worker", "logger": "vllm.config", '
    '"msg": "eager"}',
    '{"level":"warn","ts":"2026-11-22T02:36:08.986Z","caller":"auth/store.go:1380",'
    '"msg":"simple token is not cryptographically signed"}',
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "W1122 02:36:01.835408   12345 fork_posix.cc:71] Other threads are currently calling into gRPC",
]


@pytest.mark.parametrize("line", SHOWN)
def test_warnings_and_errors_of_every_known_format_reach_the_console(line: str) -> None:
    assert OutputFilter().shows(line)


@pytest.mark.parametrize("line", HIDDEN)
def test_info_lines_progress_bars_and_libraries_warnings_stay_in_the_log_file(line: str) -> None:
    assert not OutputFilter().shows(line)


def test_a_traceback_is_shown_whole_and_ends_at_its_exception_line() -> None:
    lines = [
        ("2026-11-22 02:40:11,186 INFO processor processor: starting", False),
        ("Traceback (most recent call last):", True),
        ('  File "/x/services/processor/__main__.py", line 3, in <module>', True),
        ("    main()", True),
        ("ValueError: boom", True),
        ("", False),
        ("During handling of the above exception, another exception occurred:", True),
        ("", True),
        ("Traceback (most recent call last):", True),
        ("  + Exception Group Traceback (most recent call last):", True),
        ("  |   File ...", True),
        ("2026-11-22 02:40:12,000 INFO processor processor: the next event", False),
        ("  an indented line after an INFO line", False),
        ("2026-11-22 02:40:12,000 ERROR processor processor: failed; its last lines:", True),
        ("  an indented line after an ERROR line", True),
        ("plain output", False),
    ]
    console_filter = OutputFilter()
    assert [console_filter.shows(text) for text, _ in lines] == [shown for _, shown in lines]


def test_a_json_line_gives_its_level_and_message() -> None:
    line = json.dumps({"level": "WARNING", "msg": "router abc (kv mode) at h:1", "component": "kv-router"})
    assert parse(line) == (logging.WARNING, "router abc (kv mode) at h:1", False)
    assert parse(json.dumps({"level": "INFO", "component": "kv-router", "logger": "kv_router", "msg": "m"})).own
    assert parse("not json {") == (None, "not json {", False)


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
@pytest.mark.parametrize(("component", "message"), [
    ("kv-router", "router d3705ade18f1bd73 (kv mode) at 127.0.0.1:46433"),
    ("processor", "processor 2af5113d7c34f7d1 for kvmesh-demo at 127.0.0.1:38905"),
    ("frontend", "frontend df0064274082c7dc listening on http://127.0.0.1:45821/v1"),
])
def test_a_services_ready_line_is_recognised_in_either_log_format(
        formatter: type[logging.Formatter], component: str, message: str) -> None:
    record = logging.LogRecord(component.replace("-", "_"), logging.INFO, __file__, 1, message, None, None)
    line = formatter(LogComponent(component)).format(record)  # type: ignore[call-arg]
    assert ready_pattern(component).search(parse(line).message), line
    assert parse(line).own
    assert not ready_pattern(component).search(parse(line.replace(message, "kv-router joined")).message)


def test_a_workers_printed_ready_line_is_recognised() -> None:
    assert ready_pattern("decode-worker").search("decode-worker ready: ba620ad452e872c5 14369348218d9bea")
    assert not ready_pattern("decode-worker").search("prefill-worker ready: ba620ad452e872c5")


def test_lines_are_split_across_chunks_and_a_line_over_the_limit_is_cut() -> None:
    splitter = LineSplitter(limit=8)
    assert splitter.feed(b"one\ntw") == ["one"]
    assert splitter.feed(b"o\r\nthree-four-five-six") == ["two"]
    assert splitter.feed(b"-seven\nlast") == ["three-fo [... 17 more bytes in the log file]"]
    assert splitter.flush() == ["last"]
    assert splitter.flush() == []
