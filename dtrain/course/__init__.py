"""The course around the library: what a learner runs to see the subject, and to practise it.

tour.py, tour_notes.py   ``dtrain tour``: every paradigm in turn on the digits, and one table of what each cost
live.py                  live MPI ranks in a notebook (ipyparallel): %%px cells run on every rank at once
exercises/               ``dtrain exercises``: the learner's stubs, and the checker that grades them
"""
