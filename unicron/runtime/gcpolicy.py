"""Python garbage collection kept off the iteration's critical path.

A collection that pauses one rank mid-iteration stalls every peer at the next collective; at scale the
pauses of many ranks compound into stragglers (Megatron-LM's ``--manual-gc`` exists for this). Two
measures:

* after the model is built, its objects are moved to the permanent generation (``gc.freeze``): later
  full collections no longer traverse the model, optimizer and Megatron modules;
* optionally (``--manual-gc-interval N``), automatic collection is off and every rank collects at the
  same iteration boundary, every N iterations, so the pauses line up instead of staggering.
"""

from __future__ import annotations

import gc


class GcPolicy:
    def __init__(self, interval: int) -> None:
        #: iterations between collections at a boundary; 0 keeps Python's automatic collection
        self.interval = interval

    def after_setup(self) -> None:
        """The model and optimizer exist: exempt everything alive now from future collections."""
        gc.collect()
        gc.freeze()
        if self.interval > 0:
            gc.disable()

    def at_boundary(self, iteration: int) -> None:
        """Called between iterations on every rank with the same ``iteration``."""
        if self.interval > 0 and iteration % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        if self.interval > 0:
            gc.enable()
