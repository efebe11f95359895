"""Runtime: sessions over compiled artifacts (prefill / decode / token choice) and generation."""
