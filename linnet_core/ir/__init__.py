"""The Linnet IR: graph, closed op set, verifier and passes."""
