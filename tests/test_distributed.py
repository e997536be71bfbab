"""specjax.distributed on one process: files written once (whole, under a temporary name, the
writer's error raised), the distributed settings read from arguments or JAX's variables, and the
watchdog's verdict on heartbeats. Many processes: tests/test_sharding.py's two-process runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from specjax import distributed
from specjax.distributed import DistributedError


def test_write_once_writes_whole_file_and_leaves_no_temporary(tmp_path):
  path = tmp_path / "sub" / "out.npz"
  seen = []

  def write(tmp):
    seen.append(tmp)
    assert tmp.endswith(".npz") and os.path.dirname(tmp) == str(tmp_path / "sub")
    with open(tmp, "w") as f:
      f.write("new")

  assert distributed.write_once(str(path), write) == str(path)
  assert path.read_text() == "new" and os.listdir(tmp_path / "sub") == ["out.npz"]
  assert distributed.write_text_once(str(path), "again") == str(path)
  assert path.read_text() == "again"


def test_write_once_failure_keeps_old_file_and_raises_writers_error(tmp_path):
  path = tmp_path / "out.json"
  path.write_text("old")

  def write(tmp):
    open(tmp, "w").write("half")
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    distributed.write_once(str(path), write)
  assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def test_one_process_is_the_writer_and_agrees_with_itself():
  assert distributed.is_writer()
  assert distributed.from_writer(lambda: {"1": 2.0}, "value") == {"1": 2.0}
  distributed.check_same([[1, 2]], "prompts")
  distributed.check_mesh_covers([])
  assert not distributed.spans_processes(None)


def test_settings_from_arguments_and_environment(monkeypatch):
  for v in distributed.ENV.values():
    monkeypatch.delenv(v, raising=False)
  assert distributed.settings() is None
  assert not distributed.initialize()  # nothing given: one process, nothing started
  assert distributed.settings("h:1", 2, 1) == {"coordinator": "h:1", "num_processes": 2,
                                                "process_id": 1}
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h:2")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.settings(process_id=0) == {"coordinator": "h:2", "num_processes": 4,
                                                "process_id": 0}
  monkeypatch.delenv("JAX_PROCESS_ID")
  with pytest.raises(DistributedError, match=r"process_id \(or \$JAX_PROCESS_ID\) not given"):
    distributed.settings()
  with pytest.raises(DistributedError, match="need 0 <= process_id < num_processes"):
    distributed.settings(process_id=4)
  with pytest.raises(DistributedError, match="must be host:port"):
    distributed.settings("localhost", 2, 0)
  with pytest.raises(DistributedError, match="not an integer"):
    distributed.settings("h:1", "two", 0)


def test_lost_peers_after_heartbeats_stand_still():
  seen = {}
  lost = distributed.lost_peers
  s = distributed.LOST_S
  assert lost({0: "1", 1: None}, seen, 0.0, me=0) == []  # process 1 not beating yet: counts
  assert lost({0: "2", 1: "1"}, seen, s / 2, me=0) == []
  assert lost({0: "3", 1: "1"}, seen, s, me=0) == []  # still for s / 2 only
  assert lost({0: "4", 1: None}, seen, 1.6 * s, me=0) == [1]  # unread, unchanged since s / 2
  # The service gone (every value None): the coordinator's silence counts from its last beat.
  seen = {}
  assert lost({0: "7", 1: "1"}, seen, 0.0, me=1) == []
  assert lost({0: None}, seen, s + 1, me=1) == [0]
  msg = distributed.lost_message([0], 1, 2, "127.0.0.1:5")
  assert "process 1 of 2 lost process 0 (the coordinator, 127.0.0.1:5)" in msg


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["bench"],
                                 ["train", "medusa", "--corpus", "c"]])
def test_cli_takes_distributed_settings(cmd, capsys, monkeypatch):
  """generate | bench | train take --coordinator / --num-processes / --process-id; incomplete
  settings are a named error before jax starts (exit status 2)."""
  from specjax import cli

  for v in distributed.ENV.values():
    monkeypatch.delenv(v, raising=False)
  with pytest.raises(SystemExit) as e:
    cli.main(cmd + ["--coordinator", "127.0.0.1:1", "--process-id", "0"])
  assert e.value.code == 2
  assert "num_processes (or $JAX_NUM_PROCESSES) not given" in capsys.readouterr().err


def test_device_grid_keeps_the_model_axis_within_a_process():
  """2 processes x 4 devices listed interleaved (as a topology might order them): each model
  group of data=2,model=4 and of data=4,model=2 is one process's; a model axis of 8 spans both."""
  from types import SimpleNamespace

  from specjax import sharding

  devs = [SimpleNamespace(id=i, process_index=i % 2) for i in range(8)]
  for shape in ((2, 4), (4, 2)):
    grid = sharding.device_grid(shape, devs)
    assert grid.shape == shape
    for row in grid:
      assert len({d.process_index for d in row}) == 1, (shape, [d.id for d in row])
    assert sorted(d.id for d in grid.flat) == list(range(8))
  assert sharding.device_grid((1, 8), devs).shape == (1, 8)
  one = [SimpleNamespace(id=i, process_index=0) for i in range(4)]
  assert [d.id for d in sharding.device_grid((2, 2), one).flat] == [0, 1, 2, 3]


_SIGTERM_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from specjax import distributed
distributed.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
print("initialized", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("SIGTERM was swallowed", flush=True)
"""


def test_sigterm_ends_a_distributed_process(tmp_path):
  """Under jax.distributed, `kill` (SIGTERM) ends the process as it would without it: jax's
  preemption service, which would take the signal as a preemption notice and carry on, is off."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD.format(root=root, port=port)],
                     env=env, capture_output=True, text=True, timeout=120)
  assert "initialized" in r.stdout, r.stderr[-2000:]
  assert "swallowed" not in r.stdout
  assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-2000:])
