"""Model-update aggregators (tff.aggregators factories) and DP accounting."""
