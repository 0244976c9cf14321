"""The request profile's steps (bench/hot_path/steps.py): a sample goes to the innermost frame a
step names, the work a library does for a step counts as that step, and what no step names is
the event loop's."""

from __future__ import annotations

from bench.hot_path.steps import EVENT_LOOP, step_names, step_of, steps_of

RUN = "Runner.run (asyncio/runners.py:118)"
SERVE = "ProcessorServicer._serve (/r/services/processor/service.py:180)"
ENCODE = "ModelTokenizer._encode (/r/services/processor/tokenizer.py:80)"
WRITE = "Session._write (/r/services/mesh/session_client.py:390)"
PROTO = "Message.SerializeToString (google/protobuf/message.py:9)"


def test_the_innermost_frame_a_step_names_wins() -> None:
    assert step_of([RUN, SERVE, ENCODE]) == "tokenize"
    assert step_of([RUN, SERVE]) == "processor: request"
    # The protobuf serialization a session write does counts as that write.
    assert step_of([RUN, WRITE, PROTO]) == step_of([RUN, WRITE]) == "session frames out (TCP or gRPC write)"


def test_a_sample_no_step_names_is_the_event_loops() -> None:
    assert step_of([RUN]) == EVENT_LOOP
    assert step_of([]) == EVENT_LOOP
    assert EVENT_LOOP in step_names()


def test_raw_lines_are_counted_by_step_and_junk_is_skipped() -> None:
    lines = [f"{RUN};{SERVE};{ENCODE} 7\n", f"{RUN} 3\n", f"{RUN};{SERVE};{ENCODE} 2\n", "\n", "no count here\n"]
    assert steps_of(lines) == {"tokenize": 9, EVENT_LOOP: 3}
