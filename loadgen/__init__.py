"""Trace synthesis, HTTP clients and load reports. Empty until the load generator issue lands."""
