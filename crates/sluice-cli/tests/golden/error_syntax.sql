selec 1;
