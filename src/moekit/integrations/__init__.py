"""Drop-in integrations of moekit layers into other libraries' models.

Data flow: a framework's model -> `moekit.integrations.<framework>.patch_model` finds its MoE blocks,
converts their weights once into `moekit.FusedMoE` layers and swaps the blocks in place -> `unpatch`
puts the original blocks back. Each integration is imported explicitly (it imports its framework), e.g.
`from moekit.integrations.transformers import patch_model`; this package imports nothing.
"""
