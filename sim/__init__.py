"""``unicron simulate``: weeks of failures on a simulated cluster, through the real decision core.

A discrete-event simulator (a heap of timed events, :mod:`sim.engine`) replays a failure trace
(:mod:`sim.trace`) against a workload (:mod:`sim.workload`) for Unicron - the coordinator's own
``DecisionCore`` with the ``WafAllocator`` and ``place`` - and for the baselines of paper §7.5
(:mod:`sim.baselines`), charging every incident by the cost model of paper Eq. 1 (:mod:`sim.costs`).
:mod:`sim.report` draws the Figure 11 panels and writes the JSON summary. docs/simulator.md has the
model, its assumptions and where each comes from.
"""
