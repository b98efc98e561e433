"""Rendezvous at fleet size: ``benchmarks.rendezvous_scale`` at the largest sizes this machine
can simulate, each agent with its own connection as on a real fleet, a longer lease TTL and
settle window (what a large fleet runs with), joins in waves; sizes that do not converge are
reported with why, and the idle cost per simulated agent says what limits the simulation.

Usage: python -m benchmarks.rendezvous_fleet [the options of benchmarks.rendezvous_scale]
"""

from benchmarks.rendezvous_scale import main

if __name__ == "__main__":
    main()
