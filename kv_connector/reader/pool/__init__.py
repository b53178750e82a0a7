"""What every client of the reader shares: the receive pool's memory and pages, leases
on samples, the values screen, and the hand-out that makes a ``Sample`` of a run of pages."""
