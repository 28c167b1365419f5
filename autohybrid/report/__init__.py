"""Human-readable views of plans and compiled programs."""
