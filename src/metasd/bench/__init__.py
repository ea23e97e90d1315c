"""`metasd bench`: Spec-Bench questions through every method, with oracles, a report and plots.

questions.py loads and selects questions; methods.py names what is measured; runners.py runs one method on one
question; history.py keeps cross-request drafter state equal for all methods; oracles.py holds the hindsight
oracle and regret; metrics.py the arithmetic; summary.py, answers.py, report.py and plots.py write the outputs;
config.py holds the settings, worker.py measures whole questions, run.py ties them together, distributed.py shards
them over Ray (cluster.py) or resumes them (partial.py), and `metasd.cli.bench` parses the subcommand.
"""
