"""What every test shares: Hypothesis' settings.

Hypothesis times the machine by default: an example slower than 200 ms fails its test, and so
does a strategy slow to draw (``HealthCheck.too_slow``). On a slow or busy CI host both fail
tests whose logic is sound (a draw of three integers once took 2.27 s there). These tests check
what the code does; its speed is the benchmarks' to show. So neither timing applies here.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("machine_independent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("machine_independent")
