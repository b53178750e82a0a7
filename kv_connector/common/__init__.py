"""Plumbing both ends share and that imports nothing of ours: metric observations
(``observe``) and the spin-then-sleep pacing of serving loops (``poller``)."""
