"""Model families: one folder each (dsa/: DeepSeek-V3.2 and GLM-5; deepseek_v4/), the record a family provides
(family.py) and the one table of them (registry.py). Nothing outside a family's folder branches on a family: it
asks the registry. common/ holds the blocks several families build with."""
