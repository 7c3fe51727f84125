"""Task specs: validation names the field and says what to do; JSON round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.allocation import EvenAllocator, WafAllocator
from coordinator.tasks import (
    MAX_LAUNCH_BYTES,
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    TaskSpec,
    load_spec_json,
    parse_task_spec,
)
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.etcd import Store

MODEL = {
    "num_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "seq_length": 2048,
    "vocab_size": 50257,
    "global_batch_size": 64,
}


def task(**fields: Any) -> dict[str, Any]:
    return {"name": "gpt-1", "command": ["python", "pretrain_gpt.py", "--tp", "2"], **fields}


def test_defaults() -> None:
    spec = parse_task_spec(task(), None)
    assert (spec.weight, spec.min_gpus, spec.tp_size, spec.pp_size, spec.model, dict(spec.env)) == (
        1.0,
        1,
        1,
        1,
        None,
        {},
    )
    assert spec.command == ("python", "pretrain_gpt.py", "--tp", "2")


def test_command_string_is_split_like_a_shell() -> None:
    spec = parse_task_spec(task(command="python train.py --name 'a b'"), None)
    assert spec.command == ("python", "train.py", "--name", "a b")


def test_json_round_trip_including_the_example() -> None:
    spec = parse_task_spec(
        task(weight=1.5, tp_size=2, pp_size=2, min_gpus=8, model=MODEL, env={"A": "1"}), 64, 8
    )
    again = TaskSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "task.json"
    if example.exists():
        parsed = parse_task_spec(json.loads(example.read_text()), None)
        assert TaskSpec.from_dict(parsed.to_dict()) == parsed


@pytest.mark.parametrize(
    ("fields", "cluster", "per_node", "message"),
    [
        ({"colour": "red"}, None, None, r"task: unknown field\(s\) \['colour'\]"),
        ({"command": []}, None, None, "task.command: is empty"),
        ({"command": ""}, None, None, "task.command: is empty"),
        ({"command": ["python", 3]}, None, None, "task.command: every argument must be a string"),
        ({"command": "python 'unclosed"}, None, None, "task.command: cannot split"),
        ({"weight": 3.0}, None, None, r"task.weight: 3.0 is outside \[0.5, 2.0\]"),
        ({"weight": 0.1}, None, None, r"task.weight: 0.1 is outside"),
        ({"weight": "high"}, None, None, "task.weight: expected a number"),
        ({"weight": True}, None, None, "task.weight: expected a number"),
        ({"min_gpus": 0}, None, None, "task.min_gpus: must be at least 1"),
        ({"min_gpus": 2.5}, None, None, "task.min_gpus: expected a positive integer"),
        ({"min_gpus": 32}, 16, None, "task.min_gpus: 32 is more than the cluster's 16 GPUs"),
        ({"tp_size": 3, "min_gpus": 3}, None, 8, "task.tp_size: 3 does not divide the 8 GPUs per node"),
        ({"tp_size": 2, "min_gpus": 3}, None, None, "task.min_gpus: 3 is not a multiple of tp_size"),
        ({"name": "GPT"}, None, None, "task.name: 'GPT' is not a valid task name"),
        ({"name": "a/b"}, None, None, "task.name"),
        ({"name": "-a"}, None, None, "task.name"),
        ({"name": "a" * 64}, None, None, "task.name"),
        ({"env": {"A": 1}}, None, None, "task.env: entry 'A'"),
        ({"env": {"UNICRON_PROGRESS_REGEX": r"^step (\d+)"}}, None, None,
         r"task.env.UNICRON_PROGRESS_REGEX: .* has no \(\?P<iteration>\.\.\.\) group"),
        ({"env": {"UNICRON_SAVE_START_REGEX": "saving (model"}}, None, None,
         "task.env.UNICRON_SAVE_START_REGEX: 'saving \\(model' is not a regular expression"),
        ({"env": {"UNICRON_PROGRESS_REGEX": "(?<=step )(?P<iteration>\\d+)"}}, None, None,
         "task.env.UNICRON_PROGRESS_REGEX: .* RE2 accepts .* lookaround"),
        ({"env": {"UNICRON_SAVE_START_REGEX": "(?<=x)" + "(" * 3000 + ")" * 3000}}, None, None,
         r"task.env.UNICRON_SAVE_START_REGEX: '\(\?<=x\)\(\(\(.*\.\.\. \(6006 characters\) is not"),
        ({"model": {**MODEL, "depth": 3}}, None, None, r"task.model: unknown field\(s\) \['depth'\]"),
        (
            {"model": {k: v for k, v in MODEL.items() if k != "vocab_size"}},
            None,
            None,
            "task.model.vocab_size: missing",
        ),
        (
            {"model": {**MODEL, "hidden_size": 2050}},
            None,
            None,
            "task.model.hidden_size: 2050 is not divisible",
        ),
        ({"model": {**MODEL, "seq_length": 0}}, None, None, "task.model.seq_length: must be at least 1"),
        ({"model": MODEL, "min_gpus": 3}, None, None, "task.min_gpus: with 3 GPUs the data-parallel size"),
    ],
)
def test_bad_specs_name_the_field(
    fields: dict[str, Any], cluster: int | None, per_node: int | None, message: str
) -> None:
    with pytest.raises(InvalidRecord, match=message):
        parse_task_spec(task(**fields), cluster, per_node)


def test_model_fields_are_bounded_so_planning_stays_quick() -> None:
    """A global batch of 10**20 was accepted and hung the leader's decision loop in the planner's
    divisor enumeration; a hidden size of 10**400 overflowed a float in it. Now each model field has a
    bound far above any real model, and a spec at every bound is planned at once."""
    for name, value in (("global_batch_size", 10**20), ("hidden_size", 10**400), ("num_layers", 4097)):
        with pytest.raises(InvalidRecord, match=rf"task\.model\.{name}: must be at most \d+ \(far above"):
            parse_task_spec(task(model={**MODEL, name: value}), None)
    # the largest of each, with a global batch of many divisors (720720 = 2^4 3^2 5 7 11 13)
    limits = {"num_layers": 4096, "hidden_size": 2**20, "num_attention_heads": 2**20, "seq_length": 2**24,
              "vocab_size": 2**24, "global_batch_size": 720720, "micro_batch_size": 1}
    spec = parse_task_spec(task(model=limits, recovery="inprocess"), None, 8)
    # fits in memory nowhere: planned as a task without a model, not starved
    assert WafAllocator("A800").allocate([spec], 64, 8, {}, set()) == EvenAllocator().allocate([spec], 64, 8, {}, set())
    spec = parse_task_spec(task(model={**MODEL, "global_batch_size": 720720}, recovery="inprocess"), None, 8)
    assert WafAllocator("A800").allocate([spec], 64, 8, {}, set())["gpt-1"] > 0


def test_a_layout_megatron_and_the_planner_refuse_is_refused_at_submission_not_left_pending() -> None:
    """num_layers % pp_size and num_attention_heads % tp_size were not checked: such a task was accepted
    and the WAF planner (whose configuration search needs both, as Megatron does) gave it 0 GPUs on an
    idle cluster on every plan, pending for ever, its reason blaming a lack of GPUs. Now it is refused
    at submission in one line naming the fields; one already in a leader's stored state still loads."""
    for fields, message in (
        ({"pp_size": 4, "model": {**MODEL, "num_layers": 30}},
         r"^task\.pp_size: 4 does not divide model\.num_layers=30; [^\n]*$"),
        ({"tp_size": 8, "model": {**MODEL, "num_attention_heads": 4}},
         r"^task\.tp_size: 8 does not divide model\.num_attention_heads=4; [^\n]*$"),
    ):
        data = task(recovery="inprocess", min_gpus=8, **fields)
        with pytest.raises(InvalidRecord, match=message):
            parse_task_spec(data, 32, 8)
        assert parse_task_spec(data, None, stored=True).model is not None
    fits = parse_task_spec(task(recovery="inprocess", tp_size=8, pp_size=4, min_gpus=32, model=MODEL), 32, 8)
    assert WafAllocator("A800").allocate([fits], 32, 8, {}, set()) == {"gpt-1": 32}


def test_missing_fields_and_non_objects() -> None:
    with pytest.raises(InvalidRecord, match=r"task\.command: missing"):
        parse_task_spec({"name": "a"}, None)
    with pytest.raises(InvalidRecord, match=r"task\.name: missing"):
        parse_task_spec({"command": ["x"]}, None)
    with pytest.raises(InvalidRecord, match="expected a JSON object"):
        parse_task_spec(["a"], None)


def test_valid_counts_respect_parallelism_and_global_batch() -> None:
    spec = parse_task_spec(task(tp_size=2, min_gpus=4, model={**MODEL, "global_batch_size": 12},
                                recovery="inprocess"), None)
    valid = [g for g in range(0, 33) if spec.valid_count(g)]
    # multiples of tp=2, at least 4, and DP (g/2) dividing the global batch of 12
    assert valid == [0, 4, 6, 8, 12, 24]


# --- what the OS refuses at launch (issue 19 item 10), and the parse boundary (items 11, 12) ---------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # the probe's spec: accepted, it preempted a running task, then exec failed "embedded null byte"
        ({"command": ["python\u0000"]}, r"task\.command\[0\]: contains a NUL byte"),
        ({"command": ["python", "-c", "x\u0000y"]}, r"task\.command\[2\]: contains a NUL byte"),
        ({"command": "python 'a\u0000b'"}, r"task\.command\[1\]: contains a NUL byte"),
        ({"command": ["python", "\ud800"]}, r"task\.command\[1\]: is not encodable as UTF-8"),
        ({"env": {"A\u0000": "1"}}, r"task\.env: name 'A\\x00' contains a NUL byte"),
        ({"env": {"A": "1\u0000"}}, r"task\.env\.A: contains a NUL byte"),
        ({"env": {"A=B": "1"}}, r"task\.env: name 'A=B' contains '='"),
        ({"env": {"": "1"}}, r"task\.env: a name is empty"),
        ({"env": {"A": "\udcff"}}, r"task\.env\.A: is not encodable as UTF-8"),
        ({"name": "a\u0000"}, r"task\.name: 'a\\x00' is not a valid task name"),
        ({"name": ".."}, "task.name"),
        ({"name": "a\n"}, "task.name"),
    ],
)
def test_what_the_os_refuses_is_invalid(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRecord, match=message):
        parse_task_spec(task(**fields), None)


def test_argv_and_env_together_are_bounded() -> None:
    # execve() counts every argv string and every "NAME=value" env string with its NUL terminator;
    # Linux refuses one string over 128 KiB and all of them over ARG_MAX. The agent adds its own env.
    fits = ["python", "x" * (MAX_LAUNCH_BYTES - len("python") - 2)]
    assert parse_task_spec(task(command=fits), None).command == tuple(fits)
    over = ["python", "x" * (MAX_LAUNCH_BYTES - len("python") - 1)]
    with pytest.raises(InvalidRecord, match=rf"task\.command, task\.env: {MAX_LAUNCH_BYTES + 1} bytes .* "
                                            rf"the limit is {MAX_LAUNCH_BYTES}"):
        parse_task_spec(task(command=over), None)
    half = "x" * (MAX_LAUNCH_BYTES // 2)
    with pytest.raises(InvalidRecord, match=r"task\.command, task\.env: \d+ bytes"):
        parse_task_spec(task(command=["python", half], env={"A": half}), None)


def test_error_messages_stay_short_whatever_the_value() -> None:
    with pytest.raises(InvalidRecord) as err:
        parse_task_spec(task(weight="w" * 100_000), None)
    assert len(str(err.value)) < 300 and "\n" not in str(err.value)


def test_load_spec_json_refuses_deep_nesting_with_one_line() -> None:
    for text in ("[" * 100_000, '{"a": ' * 40_000, "[" * (MAX_SPEC_DEPTH + 1) + "]" * (MAX_SPEC_DEPTH + 1)):
        with pytest.raises(InvalidRecord, match=rf"task: nested deeper than {MAX_SPEC_DEPTH} levels"):
            load_spec_json(text)
    # brackets inside strings are not nesting
    assert load_spec_json(json.dumps({"name": "a", "command": ["[" * 1000]}))["command"] == ["[" * 1000]


def test_load_spec_json_refuses_an_oversize_spec_naming_the_limit() -> None:
    text = json.dumps(task(env={"BIG": "x" * 2_000_000}))
    with pytest.raises(InvalidRecord, match=rf"task: the spec is {len(text)} bytes; the limit is {MAX_SPEC_BYTES}"):
        load_spec_json(text)


def test_load_spec_json_names_bad_json() -> None:
    with pytest.raises(InvalidRecord, match=r"task: not valid JSON: Expecting value at line 1 column 2"):
        load_spec_json("[")


def test_a_valid_spec_always_fits_in_one_etcd_request(store: Store) -> None:
    # The largest spec validation accepts, in the form the coordinator stores (json.dumps writes a
    # control character as \\u00XX: 6 bytes for 1), must be a write etcd takes (default limit 1.5 MiB).
    argv = ["python", "\x01" * (MAX_LAUNCH_BYTES - len("python") - 2)]
    spec = parse_task_spec(task(command=argv), None)
    stored = json.dumps(spec.to_dict())
    assert len(stored) > 1.5 * 2**20 / 2  # near etcd's limit, so the test can fail if the bound grows
    store.put("/unicron-test-size/tasks/gpt-1", stored)
    kv = store.get("/unicron-test-size/tasks/gpt-1")
    assert kv is not None and TaskSpec.from_dict(json.loads(kv.value)) == spec


def test_a_key_given_twice_in_a_spec_is_refused_naming_it() -> None:
    """JSON keeps the last of two equal keys silently: a spec copied and edited at its end ran under
    the name it was copied from."""
    with pytest.raises(InvalidRecord, match=r"^job.json: key 'name' is given twice in one object; keep one$"):
        load_spec_json('{"name": "t", "command": ["python", "x.py"], "name": "u"}', "job.json")
    assert load_spec_json('{"name": "t", "model": {"layers": 2}, "layers": 3}', "job.json")["layers"] == 3


def test_a_stored_spec_with_a_job_regex_accepted_before_its_check_still_loads() -> None:
    """The job-format regexes are checked at submission since 28de02e; a spec a leader accepted before
    (a progress regex without its iteration group) must still load from its state, or the new leader
    leaves the running task out and stops its ranks."""
    data = task(env={"UNICRON_PROGRESS_REGEX": r"^step (\d+)"})
    with pytest.raises(InvalidRecord, match="UNICRON_PROGRESS_REGEX"):
        parse_task_spec(data, None)
    assert parse_task_spec(data, None, stored=True).env["UNICRON_PROGRESS_REGEX"] == r"^step (\d+)"
