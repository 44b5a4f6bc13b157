"""Virtual-time simulator driving the live policy code. Empty until the scheduler issue lands."""
