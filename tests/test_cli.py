"""The CLI reports user errors as one line and exit status 2, and wires every subcommand."""

from __future__ import annotations

import pytest

from specjax import cli


def test_unknown_model_is_a_clean_error(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--model", "no-such-model", "--prompt", "hi"])
  assert e.value.code == 2
  assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_unknown_method_is_a_clean_error(capsys, monkeypatch):
  import specjax as sj

  monkeypatch.setattr(sj, "load_model", lambda name, **kw: object())
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--prompt", "hi", "--method", "telepathy"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--method 'telepathy' is unknown" in err and "prompt-lookup" in err


def test_every_registered_method_is_offered():
  from specjax import methods

  assert cli._registry_names() == methods.names()
  assert {"autoregressive", "draft", "layer-skip", "prompt-lookup", "lookahead", "medusa", "eagle",
          "mtp"} <= set(methods.names())


def test_aliases_and_options_reach_the_registry(monkeypatch):
  """--method self-spec is layer-skip, built by the registry with --exit-layer / --gamma."""
  import argparse

  from specjax import methods

  seen = {}
  monkeypatch.setattr(methods, "build", lambda name, model, **kw: seen.update(name=name, **kw))
  args = argparse.Namespace(exit_layer=2, gamma=4)
  cli._make_method("self-spec", object(), args)
  assert seen == {"name": "layer-skip", "exit_layer": 2, "gamma": 4}


def test_train_draft_arguments_reach_train_draft(monkeypatch):
  from specjax.training import draft as train

  seen = {}
  monkeypatch.setattr(train, "train_draft",
                      lambda model, corpus, **kw: seen.update(model=model, corpus=corpus, **kw))
  cli.main(["train", "draft", "--model", "m", "--corpus", "c/", "--steps", "7", "--out-dir", "/tmp/x",
            "--soft-top-k", "4", "--export", "d.npz"])
  assert seen["model"] == "m" and seen["corpus"] == "c/" and seen["steps"] == 7
  assert seen["out_dir"] == "/tmp/x" and seen["soft_top_k"] == 4 and seen["export"] == "d.npz"
  assert seen["num_layers"] is None  # train_draft's default: 2, or an --init asset's own count
  cli.main(["train", "draft", "--corpus", "c/", "--num-layers", "3", "--init", "a.npz"])
  assert seen["num_layers"] == 3 and seen["init"] == "a.npz"


@pytest.mark.parametrize("sub,fn", [("generate", "cmd_generate"), ("bench", "cmd_bench")])
@pytest.mark.parametrize("argv,nodes", [([], None), (["--nodes", "8"], 8)])
def test_eagle_nodes_option(monkeypatch, sub, fn, argv, nodes):
  """--nodes reaches sj.Eagle from the generate and bench parsers; without it (or 0) sj.Eagle's
  own default holds: left out, so chosen from the cost curve (methods/sizing.py)."""
  import specjax as sj

  import dataclasses

  from specjax import methods

  seen = {}
  fake = lambda target, heads=None, **kw: seen.update(kw) or "eagle"  # noqa: E731
  monkeypatch.setitem(methods.REGISTRY, "eagle", dataclasses.replace(methods.REGISTRY["eagle"],
                                                                     factory=fake))
  monkeypatch.setattr(cli, fn, lambda args: seen.setdefault(
      "made", cli._make_method("eagle", object(), args)))
  cli.main([sub] + (["--prompt", "hi"] if sub == "generate" else []) + argv)
  default = sj.Eagle.__dataclass_fields__["num_nodes"].default
  assert seen["made"] == "eagle" and seen.get("num_nodes", default) == nodes
