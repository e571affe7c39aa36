select n_name, n_regionkey / (n_nationkey - n_nationkey) from nation;
