"""Model implementations and HF-format weight loading."""
