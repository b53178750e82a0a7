"""Plumbing both ends share and that imports nothing of ours: metric observations
(``observe``), the spin-then-sleep pacing of serving loops (``poller``), the CUDA
device a thread works on (``device``), state machines' tables of transitions
(``transitions``), and the project's one family of errors (``errors``)."""
