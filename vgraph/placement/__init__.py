"""A partitioned network as files: one network per PNode plus placement.json and back (`export`), and the
replica plan as a report (`replica_report`)."""
