"""The frame protocol between the daemon and a worker, the program ABI, the mailbox."""
