"""The paper's model of speculative decoding's speed: Theorem 3.8's expected improvement, the factors a
measured speedup departs from it by, and section 3.5's best γ."""


def predicted_speedup(alpha, gamma, c):
    """Theorem 3.8: expected walltime improvement (1 - α^(γ+1)) / ((1 - α)(γc + 1))."""
    if alpha >= 1:  # the limit: every guess accepted, γ + 1 tokens per target call
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def ratio_factors(alpha, gamma, c, verify_cost, tokens_per_call, decode_speedup):
    """Measured ÷ predicted as three factors, to tell where a shortfall comes from: tokens per target call
    against the i.i.d. expectation (1 - α^(γ+1)) / (1 - α); the theorem's cost of a call, 1 + γc, against
    the measured verify cost + γc; and what neither models (the loop's own work, host syncs)."""
    modelled = tokens_per_call / (verify_cost + gamma * c)
    return {"tokens_per_call": tokens_per_call / predicted_speedup(alpha, gamma, 0.0),
            "verify_cost": (1 + gamma * c) / (verify_cost + gamma * c), "loop": decode_speedup / modelled}


def best_gamma(alpha, c, max_gamma=16):
    """Section 3.5: the integer γ in 1..max_gamma maximizing Theorem 3.8; returns (γ, its speedup).
    A speedup below 1 means no γ helps (Corollary 3.9: speculation wins iff α > c)."""
    return max(((g, predicted_speedup(alpha, g, c)) for g in range(1, max_gamma + 1)), key=lambda gs: gs[1])
