"""The driver: what runs in the user's process (a terminal, or the entry process of ``ray job
submit``) before, around and after a strategy trains.

It parses the flags (``entry``), prepares a run without Ray (``prepare``: re-run rules, data,
model, initial weights, storage), connects to Ray (``connect``), checks and waits for resources
(``resources``), turns Ctrl-C and SIGTERM into a clean stop (``interrupts``), and writes the run's
outputs (``outputs``, ``summary``: ``model.pt`` and ``summary.json``). Strategies call into it;
nothing here runs inside a Ray Train worker or a stage actor, and nothing here imports a strategy.
"""
