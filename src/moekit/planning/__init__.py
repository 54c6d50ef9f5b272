"""Planning: which kernel and config a spec gets on a device, decided once when a layer is built.

Data flow: `tuned` loads and validates the tuned tables (shipped in `tables/`, then the user's) ->
`plan` asks every registered kernel whether it `supports` the spec, looks the tables up and returns a
frozen `Plan`, with the reasons for every refusal.
"""
