"""The Ray actors: one host store per node (:mod:`.host_store`) and one registry per
namespace (:mod:`.registry`). Neither imports torch."""
