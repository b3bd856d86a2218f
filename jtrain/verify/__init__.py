"""Proofs that run whole trainings as child processes and compare what they leave: the
floor above the engine: they launch runs and watch what those runs write.

    resume      `--verify_resume`: a run killed and restarted against an uninterrupted
                one, final state hashes compared
    topologies  `--verify_topologies`: the same run on several device counts, hashes.jsonl
                and evals compared step by step
"""
