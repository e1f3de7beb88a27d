"""Storage tiers: where chunk objects live once they leave the engine's GPU blocks.

Every tier answers the same questions (which of these keys do you hold, reserve room
for new objects, pin objects while they are read, usage and capacity, eviction,
close). L1 is pinned host memory that movers copy into and out of directly; L2
tiers (disk, Redis) implement the same interface. Tiers never import the server.
"""
