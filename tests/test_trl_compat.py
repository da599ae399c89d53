"""What a TRL user watches a run with: trackers, the completions table, callbacks, TRL's metrics,
save_model. Every tracker is read back from what its own library wrote, offline."""

import glob
import json
import math
import struct
import time

import pytest
import torch

from cppo.config import CPPOConfig
from cppo.errors import ConfigError
from cppo.models import load_tokenizer
import helpers


def length_reward(prompts, completions, completion_ids=None, **kw):
    """Varied rewards on a random model: 1 for completions of odd length, 0 otherwise."""
    return [float(len(c) % 2) for c in completions]


def short_reward(prompts, completions, completion_ids=None, **kw):
    return [-float(len(c)) / 10 for c in completions]




def make_trainer(model_dir, tmp_path, rewards=(length_reward,), callbacks=None, **overrides):
    return helpers.make_trainer(model_dir, tmp_path / "run", reward=list(rewards),
                                callbacks=callbacks, **{"save_steps": 0, **overrides})


def read_metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ trackers ----------------
def test_unknown_tracker_is_refused_by_name():
    with pytest.raises(ConfigError, match="'report_to' has 'mlflow'.*allowed: jsonl, tensorboard, "
                                          "wandb, trackio, none, all"):
        CPPOConfig(report_to=["mlflow"])


def test_missing_tracker_library_names_the_extra(monkeypatch, tiny_model_dir, tmp_path):
    import cppo.run.tracking as tracking
    monkeypatch.setattr(tracking, "installed", lambda name: name != "wandb")
    with pytest.raises(ConfigError, match=r"'wandb' package is not installed.*cppo\[wandb\]"):
        make_trainer(tiny_model_dir, tmp_path, report_to=["wandb"])
    assert not (tmp_path / "run").exists()   # refused before anything was written


def test_all_and_none_resolve_as_in_transformers(monkeypatch):
    import cppo.run.tracking as tracking
    monkeypatch.setattr(tracking, "installed", lambda name: name == "trackio")
    assert tracking.resolve_report_to(["all"]) == ["trackio"]
    assert tracking.resolve_report_to("none") == []
    assert tracking.resolve_report_to(["jsonl", "wandb"]) == ["wandb"]


def test_tensorboard_event_files_hold_the_metrics(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    make_trainer(tiny_model_dir, tmp_path, max_steps=2, report_to=["tensorboard"]).train()
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    jsonl = {r["step"]: r for r in read_metrics(tmp_path / "run") if "reward" in r}
    events = {e.step: e.value for e in acc.Scalars("reward")}
    assert events.keys() == jsonl.keys() == {1, 2}
    assert all(math.isclose(events[s], jsonl[s]["reward"], rel_tol=1e-5, abs_tol=1e-6) for s in events)
    assert "completions/mean_terminated_length" in acc.Tags()["scalars"]


def wandb_records(run_file):
    """Records of a wandb offline run file (.wandb: W&B's LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2
    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if pos + length > len(data):   # a record still being written
            return
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):   # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_holds_metrics_and_completions_table(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)   # cppo makes it offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    make_trainer(tiny_model_dir, tmp_path, max_steps=2, report_to=["wandb"],
                 log_completions=True, num_completions_to_print=4).train()
    (run_file,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(600):   # wandb's service writes the file in the background: wait for its end
        records = list(wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    history = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    jsonl = {r["step"]: r for r in read_metrics(tmp_path / "run") if "reward" in r}
    logged = {int(h["_step"]): float(h["reward"]) for h in history if "reward" in h}
    assert logged.keys() == jsonl.keys() == {1, 2}
    assert all(math.isclose(logged[s], jsonl[s]["reward"], rel_tol=1e-5, abs_tol=1e-6) for s in logged)
    tables = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "files" / "media"
                                  / "table" / "completions_*.table.json")))
    assert len(tables) == 2
    table = json.loads(open(tables[-1]).read())
    assert table["columns"] == ["step", "prompt", "completion", "length_reward", "reward",
                                "advantage", "kept"]
    assert len(table["data"]) == 4


def test_trackio_local_store_holds_metrics_and_completions(tiny_model_dir, tmp_path, monkeypatch):
    trackio = pytest.importorskip("trackio")
    import trackio.sqlite_storage as storage
    import trackio.utils as utils
    for module in (storage, utils, trackio):   # the store is read from these at import time
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio", raising=False)
    monkeypatch.setenv("TRACKIO_PROJECT", "cppo-test")
    make_trainer(tiny_model_dir, tmp_path, max_steps=2, report_to=["trackio"], run_name="r1",
                 log_completions=True, num_completions_to_print=3).train()
    logs = storage.SQLiteStorage.get_logs("cppo-test", "r1")
    jsonl = {r["step"]: r for r in read_metrics(tmp_path / "run") if "reward" in r}
    logged = {e["step"]: e["reward"] for e in logs if "reward" in e}
    assert logged.keys() == jsonl.keys() == {1, 2}
    assert all(math.isclose(logged[s], jsonl[s]["reward"], rel_tol=1e-5, abs_tol=1e-6) for s in logged)
    tables = [e["completions"] for e in logs if "completions" in e]
    assert len(tables) == 2 and len(tables[-1]["_value"]) == 3
    assert {"prompt", "completion", "advantage", "kept"} <= tables[-1]["_value"][0].keys()


# ------------------------------------------------------------------ completions table -------
def test_completions_table_marks_pruned_rows(tiny_model_dir, tmp_path, capsys):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=2, log_completions=True,
                           rewards=(length_reward, short_reward))
    trainer.train()
    records = [json.loads(line) for line in
               (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    kept_per_step = trainer.plan.completions_kept
    scored_per_step = trainer.plan.questions_per_step * 4
    assert [r["step"] for r in records] == [1] * scored_per_step + [2] * scored_per_step
    step2 = [r for r in records if r["step"] == 2]
    assert sum(r["kept"] for r in step2) == kept_per_step < len(step2)
    for r in step2:   # weighted sum of the functions; kept = largest |advantage|
        assert math.isclose(r["reward"], r["length_reward"] + r["short_reward"], abs_tol=1e-3)
    smallest_kept = min(abs(r["advantage"]) for r in step2 if r["kept"])
    assert all(abs(r["advantage"]) <= smallest_kept + 1e-4 for r in step2 if not r["kept"])
    out = capsys.readouterr().out
    assert "completions at step 2" in out and "PRUNED" in out and "kept" in out


def test_completions_table_off_writes_nothing(tiny_model_dir, tmp_path):
    make_trainer(tiny_model_dir, tmp_path, max_steps=1, log_completions=False).train()
    assert not (tmp_path / "run" / "completions.jsonl").exists()


# ------------------------------------------------------------------ metrics -----------------
def test_metrics_are_averaged_over_the_logging_window(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback
    seen = []

    class Spy(TrainerCallback):
        pass

    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=4, logging_steps=2,
                           callbacks=[Spy()])
    original = trainer.step_metrics

    def spy(*args, **kwargs):
        metrics = original(*args, **kwargs)
        seen.append(metrics)
        return metrics
    trainer.step_metrics = spy
    trainer.train()
    train = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in train] == [2, 4]
    for record, pair in zip(train, (seen[0:2], seen[2:4])):
        for key in ("reward", "reward_std", "completions/mean_length", "cppo/kept_fraction"):
            assert math.isclose(record[key], (pair[0][key] + pair[1][key]) / 2, abs_tol=1e-5), key


def test_trl_metric_keys_are_logged(tiny_model_dir, tmp_path):
    make_trainer(tiny_model_dir, tmp_path, max_steps=2,
                 rewards=(length_reward, short_reward)).train()
    record = [r for r in read_metrics(tmp_path / "run") if "reward" in r][-1]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/length_reward/mean",
                "rewards/length_reward/std", "rewards/short_reward/std", "num_tokens",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "completions/mean_terminated_length",
                "completions/min_terminated_length", "completions/max_terminated_length",
                "loss", "grad_norm", "learning_rate", "entropy"):
        assert key in record, key
    assert record["completions/min_length"] <= record["completions/mean_length"] \
        <= record["completions/max_length"]
    first = [r for r in read_metrics(tmp_path / "run") if "reward" in r][0]
    assert 0 < first["num_tokens"] < record["num_tokens"]   # cumulative, as TRL's
    prompt_tokens = len(load_tokenizer(tiny_model_dir)(helpers.ROWS[0]["prompt"])["input_ids"])
    scored = first["cppo/completions_scored"]   # every prompt here has the same length
    assert first["num_tokens"] == round(scored * (prompt_tokens + first["completions/mean_length"]))


def test_entropy_is_the_policy_entropy_over_completion_tokens(tiny_model_dir, tmp_path):
    from cppo.sampling.logprobs import completion_logprobs, token_entropy
    logits = torch.randn(2, 3, 11)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(token_entropy(logits), expected, atol=1e-5)
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    ids = torch.tensor([[5, 6, 7]])
    entropies = []
    completion_logprobs(trainer.policy, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long),
                        ids, torch.ones(1, 3, dtype=torch.long), entropies=entropies)
    with torch.no_grad():
        full = trainer.policy(torch.tensor([[3, 4, 5, 6, 7]])).logits[:, 1:4]
    assert torch.allclose(entropies[0], torch.distributions.Categorical(logits=full).entropy(),
                          atol=1e-4)


def test_length_metrics_match_trl_definitions():
    from cppo.run.tracking import length_metrics
    lengths = torch.tensor([3.0, 5.0, 8.0, 8.0])
    truncated = torch.tensor([False, False, True, True])
    m = length_metrics(lengths, truncated)
    assert m["completions/min_length"] == 3 and m["completions/max_length"] == 8
    assert m["completions/mean_terminated_length"] == 4.0
    assert m["completions/max_terminated_length"] == 5 and m["completions/clipped_ratio"] == 0.5
    none_ended = length_metrics(lengths, torch.ones(4, dtype=torch.bool))
    assert none_ended["completions/mean_terminated_length"] == 0.0


def test_reward_std_follows_scale_rewards_as_trl():
    from cppo.algorithm import reward_stats
    rewards = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    group = reward_stats(rewards, "group")
    assert math.isclose(group["reward_std"], (2 ** -0.5) / 2, rel_tol=1e-6)
    assert group["frac_reward_zero_std"] == 0.5
    batch = reward_stats(rewards, "batch")
    assert math.isclose(batch["reward_std"], rewards.flatten().std().item(), rel_tol=1e-6)
    assert batch["frac_reward_zero_std"] == 0.0


def test_metrics_window_skips_nan_and_keeps_last_learning_rate():
    from cppo.run.tracking import MetricsWindow
    w = MetricsWindow()
    w.add({"reward": 1.0, "rewards/f/mean": math.nan, "learning_rate": 0.1, "flag": True})
    w.add({"reward": 3.0, "rewards/f/mean": 2.0, "learning_rate": 0.2})
    out = w.flush()
    assert out == {"reward": 2.0, "rewards/f/mean": 2.0, "learning_rate": 0.2}
    assert w.flush() == {}


# ------------------------------------------------------------------ callbacks ---------------
def test_callback_stops_the_run_with_a_checkpoint(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def __init__(self, n):
            self.n, self.events = n, []

        def on_train_begin(self, args, state, control, **kw):
            self.events.append("train_begin")

        def on_step_end(self, args, state, control, **kw):
            self.events.append(("step_end", state.global_step))
            if state.global_step >= self.n:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kw):
            self.events.append(("save", state.global_step))

        def on_train_end(self, args, state, control, **kw):
            self.events.append("train_end")

    stop = StopAfter(2)
    summary = make_trainer(tiny_model_dir, tmp_path, max_steps=6, callbacks=[stop]).train()
    assert summary["status"] == "stopped_by_callback" and summary["steps"] == 2
    assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").is_file() \
        or any((tmp_path / "run" / "checkpoint-2").iterdir())
    assert stop.events == ["train_begin", ("step_end", 1), ("step_end", 2), ("save", 2), "train_end"]


def test_logging_callback_sees_the_metrics_of_metrics_jsonl(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback, TrainerControl, TrainerState

    class Recorder(TrainerCallback):
        logs, evals, kinds = [], [], set()

        def on_log(self, args, state, control, logs=None, **kw):
            self.kinds.add((type(state), type(control)))
            self.logs.append(dict(logs))

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            self.evals.append(metrics)

    make_trainer(tiny_model_dir, tmp_path, max_steps=3, callbacks=[Recorder]).train()
    train = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert Recorder.logs == train
    assert Recorder.kinds == {(TrainerState, TrainerControl)}
    assert len(Recorder.evals) == 2 and "eval_accuracy" in Recorder.evals[0]


def test_callback_should_save_writes_a_checkpoint(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    class SaveAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step == 1

    make_trainer(tiny_model_dir, tmp_path, max_steps=3, save_total_limit=5,
                 callbacks=[SaveAtOne()]).train()
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_callback_that_raises_stops_with_a_checkpoint_and_its_error(tiny_model_dir, tmp_path):
    from cppo.errors import CallbackError
    from transformers import TrainerCallback

    class Broken(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                raise KeyError("no such metric")

    with pytest.raises(CallbackError, match=r"callback Broken.on_step_end raised KeyError: "
                                            r"'no such metric'"):
        make_trainer(tiny_model_dir, tmp_path, max_steps=5, callbacks=[Broken()]).train()
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward" in r] == [1, 2]


def test_a_non_callback_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="not a transformers.TrainerCallback"):
        make_trainer(tiny_model_dir, tmp_path, callbacks=[lambda *a: None])


# ------------------------------------------------------------------ save_model --------------
def test_save_model_writes_a_folder_from_pretrained_loads(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.train()
    out = trainer.save_model(tmp_path / "final")
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("12*34=")["input_ids"] == trainer.tokenizer("12*34=")["input_ids"]
    for (name, a), (_, b) in zip(model.state_dict().items(), trainer.policy.state_dict().items()):
        assert torch.equal(a, b.cpu()), name
