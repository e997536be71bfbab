"""Many processes, one program: jax.distributed set up with heartbeats, values agreed across
processes, and files written once.

Under jax.distributed every process runs the same Python program, and every compiled program
spans every process: if two processes choose different sizes (a cost curve measured on each), they
compile different programs and hang in mismatched collectives. So whatever decides a program's
shape is decided once, by process 0, and handed to the others (`from_writer`), and what a user
passes (prompts, sampling settings) is checked to be the same everywhere (`check_same`).

Files are written by process 0 only (`is_writer`); the others wait for process 0's word that the
file is there (`write_once`), then read it as process 0 does. One process: every call here is a
no-op (the writer is this process).

    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # or from $JAX_*
    distributed.write_once(path, lambda tmp: save(tmp))

Faults. jax.distributed's own heartbeats end a process whose peer died with a C++ abort after
`heartbeat_timeout_seconds` (100 s by default), and a collective with a dead peer fails with a
transport error that names no process, after which jax's exit waits at a shutdown barrier for the
dead one. `initialize` starts a watchdog thread: every POLL_S seconds each process bumps its own
heartbeat key in the coordination service's key-value store and reads the others'; a process
whose key stood still for LOST_S seconds is lost, and the survivor ends with one line naming it
(exit status LOST_EXIT), within about LOST_S + POLL_S of the loss. An uncaught error (the failed
collective) waits for that verdict, then ends the process without jax's shutdown barrier.
jax.distributed's own heartbeat timeout is set to HEARTBEAT_S, a backstop past LOST_S.
Process 0 runs the coordination service: when it dies, jax's client in every other process aborts
at once ("the JAX distributed service detected fatal errors"; its error callback cannot be set
from Python in jax 0.10), before the watchdog can speak; the watchdog still names process 0 where
the service merely stops answering.
jax's preemption service is left off: it takes SIGTERM for a preemption notice that only code
calling `multihost_utils.reached_preemption_sync_point` hears, so a `kill` would be swallowed.
With it off, SIGTERM ends a process as it does without jax.distributed (training catches it and
saves a checkpoint first), and the watchdog names that process to the others.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import jax

from specjax.errors import InputError, SpecJaxError

LOST_S = 10.0  # a process whose heartbeat stood still this long is lost
POLL_S = 1.0  # the watchdog's heartbeat period
HEARTBEAT_S = 30  # jax.distributed's own heartbeat timeout: a backstop after LOST_S
BARRIER_S = 3600  # the longest a process waits for process 0's value (it may be measuring)
LOST_EXIT = 3  # the exit status of a process that lost a peer
ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


class DistributedError(SpecJaxError, RuntimeError):
  """Processes that do not agree (different prompts or settings), or bad distributed settings."""


_state = {"broadcasts": 0, "watchdog": None, "ending": False}


# ----------------------------------------------------------------------------- set-up


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> dict | None:
  """The distributed settings from arguments, else $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES,
  $JAX_PROCESS_ID; None when none is given (one process). Raises DistributedError naming what is
  missing or malformed."""
  given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
  got = {k: v if v is not None else os.environ.get(ENV[k]) for k, v in given.items()}
  if all(v is None for v in got.values()):
    return None
  missing = [f"{k} (or ${ENV[k]})" for k, v in got.items() if v is None]
  if missing:
    raise DistributedError(f"distributed settings incomplete: {', '.join(missing)} not given "
                           f"(have {got}); give all three, or none for one process")
  for k in ("num_processes", "process_id"):
    try:
      got[k] = int(got[k])
    except (TypeError, ValueError):
      raise DistributedError(f"{k}={got[k]!r} is not an integer") from None
  if got["num_processes"] < 1 or not 0 <= got["process_id"] < got["num_processes"]:
    raise DistributedError(f"process_id={got['process_id']} with num_processes="
                           f"{got['num_processes']}: need 0 <= process_id < num_processes")
  if ":" not in str(got["coordinator"]):
    raise DistributedError(f"coordinator={got['coordinator']!r} must be host:port")
  return got


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_s: int = HEARTBEAT_S,
               watchdog: bool = True) -> bool:
  """jax.distributed.initialize with `settings(...)` (False, nothing done, when there are none),
  gloo collectives on CPU, heartbeats of heartbeat_s and the watchdog (see the module docstring).
  Call it before anything else touches jax."""
  s = settings(coordinator, num_processes, process_id)
  if s is None:
    return False
  if "cpu" in os.environ.get("JAX_PLATFORMS", "cpu").split(","):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)  # SIGTERM ends the process (above)
  jax.distributed.initialize(coordinator_address=s["coordinator"],
                             num_processes=s["num_processes"], process_id=s["process_id"],
                             heartbeat_timeout_seconds=heartbeat_s)
  if watchdog and s["num_processes"] > 1:
    start_watchdog(s["num_processes"], s["process_id"], s["coordinator"])
  return True


def _client():
  from jax._src import distributed as jd

  return jd.global_state.client


def lost_message(lost: list[int], me: int, n: int, coordinator: str) -> str:
  """The line a process prints when it ends for lost peers."""
  who = ", ".join(f"process {i}" + (f" (the coordinator, {coordinator})" if i == 0 else "")
                  for i in lost)
  return (f"specjax: process {me} of {n} lost {who}: no heartbeat for {LOST_S:g} s; ending this "
          f"process (exit status {LOST_EXIT}), as every process must run the same program")


def lost_peers(beats: dict, last_seen: dict, now: float, me: int) -> list[int]:
  """The processes whose heartbeat has not changed for LOST_S seconds. beats: {process: its
  latest heartbeat value, None where it could not be read}; last_seen: {process: (value, when
  it last changed)}, updated in place. A process never seen counts from its first reading."""
  lost = []
  for i, value in beats.items():
    seen = last_seen.get(i)
    if seen is None or (value is not None and value != seen[0]):
      last_seen[i] = (value, now)
    elif i != me and now - seen[1] > LOST_S:
      lost.append(i)
  return lost


def _beat(client, me: int, n: int, count: int) -> dict:
  """Sets this process's heartbeat to `count` and reads every process's: {process: value},
  None for one not readable (not yet beating, or the service not answering)."""

  def read(i):
    try:
      return client.key_value_try_get(f"specjax/alive/{i}")
    except Exception:  # not found, or the service is gone
      return None

  try:
    client.key_value_set(f"specjax/alive/{me}", str(count), allow_overwrite=True)
  except Exception:  # the service (process 0) does not answer
    return {i: None for i in range(n)}
  return {i: str(count) if i == me else read(i) for i in range(n)}


def _watch(n: int, me: int, coordinator: str) -> None:
  """The watchdog's loop: beats every POLL_S, and ends the process when a peer's beat has
  stood still for LOST_S (process 0's too when the service, which it runs, stops answering).
  A process that is ending (at exit, waiting in jax's shutdown for the others) still beats, so
  that the others, still working, do not count it lost, but judges no more."""
  client, last_seen, count = _client(), {}, 0
  while _client() is client:
    count += 1
    beats = _beat(client, me, n, count)
    if me != 0 and beats[me] is None:
      beats = {0: None}  # the service does not answer: only the coordinator's silence counts
    lost = lost_peers(beats, last_seen, time.monotonic(), me)
    if lost and _client() is client and not _state["ending"]:
      print(lost_message(lost, me, n, coordinator), file=sys.stderr, flush=True)
      os._exit(LOST_EXIT)
    time.sleep(POLL_S)


def _end_on_error(previous):
  """sys.excepthook under jax.distributed: after the traceback, wait for the watchdog to name a
  lost process (a failed collective usually means one), then end without jax's shutdown barrier,
  which would wait for the lost process and abort."""
  def hook(kind, value, tb):
    previous(kind, value, tb)
    if _state["ending"] or _client() is None:
      return
    print(f"specjax: process {jax.process_index()} failed (above); waiting up to "
          f"{LOST_S + 2 * POLL_S:g} s for a lost process to be named", file=sys.stderr, flush=True)
    time.sleep(LOST_S + 2 * POLL_S)  # the watchdog ends the process first if a peer was lost
    os._exit(1)

  return hook


def start_watchdog(n: int, me: int, coordinator: str) -> None:
  """Starts `_watch` on a daemon thread and the error hook (once per process); at exit (before
  jax's own clean-up) the watchdog stops judging."""
  if _state["watchdog"] is None:
    t = threading.Thread(target=_watch, args=(n, me, coordinator), daemon=True,
                         name="specjax-watchdog")
    t.start()
    _state["watchdog"] = t
    sys.excepthook = _end_on_error(sys.excepthook)
    atexit.register(lambda: _state.update(ending=True))


# ----------------------------------------------------------------------------- agreement


def is_writer() -> bool:
  """Whether this process writes shared files (process 0; the only process, with one)."""
  return jax.process_index() == 0


def from_writer(fn: Callable[[], Any], name: str) -> Any:
  """fn() as process 0 computes it, on every process (the others do not call fn). The value must
  survive JSON (dict keys come back as strings)."""
  if jax.process_count() == 1:
    return fn()
  _state["broadcasts"] += 1
  key = f"specjax/broadcast/{_state['broadcasts']}/{name}"
  if is_writer():
    value = fn()
    _client().key_value_set(key, json.dumps(value))
    return value
  return json.loads(_client().blocking_key_value_get(key, BARRIER_S * 1000))


def fingerprint(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def check_same(value: Any, what: str) -> None:
  """Raises DistributedError (before anything compiles) unless `value` (JSON-able) is the same on
  every process; the message names `what` and the processes that differ from process 0."""
  if jax.process_count() == 1:
    return
  mine = fingerprint(value)
  _state["broadcasts"] += 1
  prefix = f"specjax/same/{_state['broadcasts']}/"
  _client().key_value_set(prefix + str(jax.process_index()), mine)
  prints = [_client().blocking_key_value_get(prefix + str(i), BARRIER_S * 1000)
            for i in range(jax.process_count())]
  differ = [i for i, p in enumerate(prints) if p != prints[0]]
  if differ:
    raise DistributedError(
        f"{what} differ across processes: process(es) {differ} were given other {what} than "
        f"process 0; under jax.distributed every process must pass the same {what} (read them "
        f"on process 0 and share them, or seed every process alike)")


def spans_processes(mesh) -> bool:
  """Whether a mesh (or None: one device) holds devices of more than one process."""
  return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def check_mesh_covers(devices) -> None:
  """Raises MeshLeavesProcessError if a mesh over `devices` leaves a process out: that process
  would run no part of the program the others' collectives wait for."""
  if jax.process_count() == 1:
    return
  have = {d.process_index for d in devices}
  left = sorted(set(range(jax.process_count())) - have)
  if left:
    raise MeshLeavesProcessError(
        f"a mesh of {len(devices)} devices leaves out process(es) {left} of "
        f"{jax.process_count()}: under jax.distributed a mesh must hold devices of every process "
        f"(use all {jax.device_count()} devices, e.g. mesh='data=-1' or sizes multiplying to "
        f"{jax.device_count()})")


class MeshLeavesProcessError(DistributedError, InputError):
  """A mesh that holds no device of some process."""


# ----------------------------------------------------------------------------- files


def write_once(path: str, write: Callable[[str], Any], name: str | None = None) -> str:
  """Process 0 calls write(tmp) and renames tmp to `path` (a reader sees the old file or the new,
  never half); the others wait until it has, so on return the file is there for every process.
  If process 0's write fails, it raises that error and the others a DistributedError naming it.
  tmp keeps path's extension (np.savez appends one otherwise) and is named by the pid, so two jobs
  writing into one folder do not collide."""
  raised = []

  def attempt():
    try:
      _write(path, write)
    except Exception as e:  # every process must hear of it, or the others wait forever
      raised.append(e)
      return f"{type(e).__name__}: {e}"
    return None

  failed = from_writer(attempt, name or f"write {os.path.basename(path)}")
  if raised:
    raise raised[0]
  if failed:
    raise DistributedError(f"process 0 could not write {path}: {failed}")
  return path


def write_text_once(path: str, text: str, name: str | None = None) -> str:
  """`text` at path, written once (write_once)."""

  def write(tmp):
    with open(tmp, "w") as f:
      f.write(text)

  return write_once(path, write, name)


def _write(path: str, write: Callable[[str], Any]) -> None:
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, f".tmp{os.getpid()}.{os.path.basename(path)}")
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
