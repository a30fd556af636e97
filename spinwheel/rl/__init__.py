"""Reinforcement-learning math shared by the classic-control and LLM trainers.

``advantages`` (GAE-λ, reward-to-go), ``losses`` (PPO clip, value, entropy, KL estimators) and ``trpo``
(conjugate gradient, Fisher-vector products, trust-region step) are pure tensor functions; ``classic`` holds
the gymnasium trainers built on them.
"""
