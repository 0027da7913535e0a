"""Watching a compute: profiles (:mod:`.profile`) and what they show
(:mod:`.report`), progress bars (:mod:`.progress`), drawings of a graph
(:mod:`.visualize`).

Imports: the program and below. Imported by the runtime's entry and the API.
"""
