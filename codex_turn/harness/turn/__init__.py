"""The turn flow: one Codex turn driven through the turn machine (:mod:`codex_turn.fsm.turn`).

:mod:`~codex_turn.harness.turn.orchestrator` is the loop (``run_codex_turn``);
:mod:`~codex_turn.harness.turn.stages` does each state's I/O and reports what happened;
:mod:`~codex_turn.harness.turn.executors` carries out the thread plan, one executor per
thread action; :mod:`~codex_turn.harness.turn.forms` gathers the facts the form and thread
tables read and renders the frame; :mod:`~codex_turn.harness.turn.structured` forks and
injects; :mod:`~codex_turn.harness.turn.steering` and
:mod:`~codex_turn.harness.turn.streaming` link a running turn to its runner;
:mod:`~codex_turn.harness.turn.context` holds what the stages share.
"""
